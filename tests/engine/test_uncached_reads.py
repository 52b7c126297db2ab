"""Reads past the page cache (``LoadOptions(page_cache="bypass")``, ``O_DIRECT`` locally): the
same bytes as a buffered read wherever a range starts and ends, of the file the snapshot pinned,
checked against the block checksums, and a plain buffered read wherever the storage or the
filesystem cannot bypass the cache.

``O_DIRECT`` wants aligned offsets, lengths and addresses; a safetensors file's tensors are
aligned to nothing, so every range here starts and ends at odd bytes, and a bounce buffer made
small (``_DIRECT_BOUNCE``) makes one read cross many of its refills.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from unittest import mock

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

import orbax_safetensors as ost
from orbax_safetensors.storage import local


def _direct_allowed(directory: Path) -> bool:
    """Whether this filesystem opens files with ``O_DIRECT`` (tmpfs before Linux 6.6 does not)."""
    probe = directory / "probe"
    probe.write_bytes(b"x")
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> tuple[Path, bytes]:
    path = tmp_path_factory.mktemp("uncached") / "data.bin"
    content = np.random.default_rng(3).integers(0, 256, 50_001, dtype=np.uint8).tobytes()  # ends mid-block
    path.write_bytes(content)
    return path, content


@settings(max_examples=60, deadline=None)
@given(offset=st.integers(0, 50_000), pieces=st.lists(st.integers(0, 12_000), min_size=1, max_size=6),
       as_float32=st.booleans())
def test_an_uncached_read_fills_the_buffers_as_a_buffered_one(data_file, offset, pieces, as_float32):
    """Any offset, any split into buffers (numpy arrays, views into one, empty ones), crossing
    the bounce buffer's refills and running up to the file's last, partial block."""
    path, content = data_file
    pieces = [min(n, len(content) - offset - sum(pieces[:i])) for i, n in enumerate(pieces)]
    pieces = [max(n, 0) for n in pieces]
    backing = np.zeros(sum(pieces) + 8, np.uint8)
    buffers, used = [], 0
    for i, n in enumerate(pieces):
        if as_float32 and n % 4 == 0 and i % 2 == 0:
            buffers.append(np.zeros(n // 4, np.float32))
        else:
            buffers.append(memoryview(backing)[used:used + n])
            used += n
    snapshot = local.LocalSnapshot()
    try:
        with mock.patch.object(local, "_DIRECT_BOUNCE", 8192):
            bypassed = snapshot.read_scatter_uncached(str(path), offset, buffers)
    finally:
        snapshot.close()
    got = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
    assert got == content[offset:offset + sum(pieces)]
    assert bypassed == _direct_allowed(path.parent)


def test_an_uncached_read_past_the_end_names_the_file(data_file):
    path, content = data_file
    snapshot = local.LocalSnapshot()
    try:
        with pytest.raises(EOFError, match=f"{path}: file ended at byte {len(content)}"):
            snapshot.read_scatter_uncached(str(path), len(content) - 10, [np.zeros(20, np.uint8)])
    finally:
        snapshot.close()


def test_an_uncached_read_reads_the_pinned_file_after_a_rename_over_its_name(tmp_path):
    """The ``O_DIRECT`` descriptor is opened from the pinned one, not from the name: an overwrite
    committed between the first read and the next is not seen."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"A" * 10_000)
    snapshot = local.LocalSnapshot()
    try:
        assert snapshot.read(str(path), 0, 1) == b"A"  # pins it
        (tmp_path / "new").write_bytes(b"B" * 10_000)
        os.replace(tmp_path / "new", path)
        out = np.zeros(5000, np.uint8)
        snapshot.read_scatter_uncached(str(path), 4321, [out])
        assert bytes(out) == b"A" * 5000
        assert not snapshot.unchanged()
    finally:
        snapshot.close()


def _refusing_direct_opens(real_open=os.open):
    def opener(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args, **kwargs)
    return opener


def _refusing_direct_reads(real_preadv=os.preadv):
    """``preadv`` failing as on a device whose block is larger than ``O_DIRECT``'s alignment here."""
    def reader(fd, buffers, offset, *args):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset, *args)
    return reader


@pytest.mark.parametrize("refusal", ["open", "read"])
def test_a_filesystem_refusing_direct_reads_is_read_buffered(data_file, refusal):
    path, content = data_file
    patch = (mock.patch.object(local.os, "open", _refusing_direct_opens()) if refusal == "open"
             else mock.patch.object(local.os, "preadv", _refusing_direct_reads()))
    snapshot = local.LocalSnapshot()
    try:
        with patch:
            for _ in range(2):  # the second read goes straight to the buffered one
                out = np.zeros(7777, np.uint8)
                assert snapshot.read_scatter_uncached(str(path), 1234, [out]) is False
                assert bytes(out) == content[1234:1234 + 7777]
    finally:
        snapshot.close()


def _tree() -> dict[str, np.ndarray]:
    """Odd sizes throughout, so that no tensor starts or ends on a block."""
    rng = np.random.default_rng(11)
    tree = {f"layer{i}.w": rng.standard_normal((136, 77)).astype(np.float32) for i in range(6)}
    return tree | {"embed": rng.standard_normal((104, 33)).astype(ml_dtypes.bfloat16),
                   "norm": rng.standard_normal((77,)).astype(np.float32),
                   "step": np.arange(3, dtype=np.int8), "flags": np.array([True, False, True])}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("bypass") / "ckpt"
    tree = _tree()
    ost.save(path, tree, max_shard_size="100KB")
    return path, tree


@pytest.mark.parametrize("spec", [P("x", None), P(None, "x"), P()], ids=["rows", "columns", "replicated"])
@pytest.mark.parametrize("chunk_bytes", [None, 4096], ids=["default-chunks", "4KiB-chunks"])
def test_a_load_past_the_page_cache_equals_the_saved_values(saved, spec, chunk_bytes):
    """Rows, columns (strided: bounce reads), replicated and grouped small tensors, checked
    against their block checksums, every byte read counted as read past the cache."""
    path, tree = saved
    mesh = jax.make_mesh((8,), ("x",))
    target = {name: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                         sharding=NamedSharding(mesh, spec if x.shape[0] % 8 == 0 and x.ndim == 2
                                                                and (spec != P(None, "x") or x.shape[1] % 8 == 0)
                                                                else P()))
              for name, x in tree.items()}
    stats = ost.LoadStats()
    loaded = ost.load(path, target, page_cache="bypass", chunk_bytes=chunk_bytes, stats=stats)
    for name, value in tree.items():
        assert loaded[name].sharding == target[name].sharding
        np.testing.assert_array_equal(np.asarray(loaded[name]), value, err_msg=name)
    assert stats.bytes_verified == stats.bytes_read > 0
    assert stats.bytes_uncached == (stats.bytes_read if _direct_allowed(path) else 0)


def test_a_load_using_the_page_cache_reads_nothing_past_it(saved):
    path, tree = saved
    stats = ost.LoadStats()
    loaded = ost.load(path, stats=stats)
    assert all(np.array_equal(loaded[k], v) for k, v in tree.items())
    assert stats.bytes_read > 0 and stats.bytes_uncached == 0


def test_damage_read_past_the_page_cache_fails_its_checksum(tmp_path):
    tree = {"w": np.arange(100_000, dtype=np.float32)}
    ost.save(tmp_path / "ckpt", tree)
    file = tmp_path / "ckpt" / "model.safetensors"
    with open(file, "r+b") as f:  # one bit of the last value
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(ost.ChecksumError, match="model.safetensors"):
        ost.load(tmp_path / "ckpt", page_cache="bypass")


def test_storage_without_a_page_cache_here_reads_as_usual():
    tree = {"w": np.arange(1000, dtype=np.float32), "b": np.arange(7, dtype=np.int8)}
    url = "memory://uncached/ckpt"
    ost.save(url, tree, overwrite=True)
    stats = ost.LoadStats()
    loaded = ost.load(url, page_cache="bypass", stats=stats)
    assert all(np.array_equal(loaded[k], v) for k, v in tree.items())
    assert stats.bytes_read > 0 and stats.bytes_uncached == 0


def test_page_cache_must_be_use_or_bypass():
    with pytest.raises(ValueError, match=r'LoadOptions.page_cache must be "use" or "bypass".*not \'off\''):
        ost.LoadOptions(page_cache="off")
