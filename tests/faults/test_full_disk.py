"""A real full filesystem: a 16 MiB tmpfs, an old checkpoint on it, and an overwrite that runs
out of space, once where the new shards fit but the commit's small files (lock, index,
journal) do not, and once where the shards themselves do not. Needs root (``mount``); skipped
elsewhere."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import orbax_safetensors as ost

pytestmark = pytest.mark.slow  # a real tmpfs filled mid-save

PAGE = 4096


def _tree(version: int) -> dict[str, np.ndarray]:
    return {f"layers.{i}.w": np.full((256, 1024), version * 10 + i, np.float32) for i in range(4)}


@pytest.fixture
def tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _pages(directory: Path) -> int:
    return sum(-(-p.stat().st_size // PAGE) * PAGE for p in directory.iterdir() if p.is_file())


def _free(mount: Path) -> int:
    stats = os.statvfs(mount)
    return stats.f_bavail * stats.f_frsize


def _fill(mount: Path, leave: int) -> Path:
    """A file of the user's outside the checkpoint that leaves ``leave`` bytes free."""
    filler = mount / "filler.bin"
    with open(filler, "wb") as f:
        f.truncate(0)
        os.posix_fallocate(f.fileno(), 0, max(_free(mount) - leave, PAGE))
    return filler


def _same(loaded: dict, expected: dict) -> bool:
    return sorted(loaded) == sorted(expected) and all(
        np.array_equal(loaded[k], expected[k]) for k in expected)


@pytest.mark.parametrize("room", ["shards but not the commit", "not even the shards"])
def test_an_overwrite_that_fills_the_disk_keeps_the_old_checkpoint(tmpfs, tmp_path, room):
    reference = tmp_path / "reference"
    ost.save(reference, _tree(2), max_shard_size="2MB")
    shards = _pages(reference) - PAGE  # the new shard files, not the index
    path = tmpfs / "ckpt"
    ost.save(path, _tree(1), max_shard_size="2MB")
    (path / "config.json").write_text('{"mine": true}')
    leave = shards + PAGE if room == "shards but not the commit" else shards // 2
    filler = _fill(tmpfs, leave)  # the lock file takes the one page over the shards
    with pytest.raises(OSError) as raised:
        ost.save(path, _tree(2), max_shard_size="2MB", overwrite=True)
    assert raised.value.errno == errno.ENOSPC, raised.value
    assert raised.value.filename and str(path) in raised.value.filename, raised.value
    print(f"{room}: {raised.value}")
    assert _same(ost.load(path), _tree(1))
    assert not [n for n in os.listdir(path) if n.startswith(".")], os.listdir(path)
    assert (path / "config.json").read_text() == '{"mine": true}'
    assert ost.verify(path).ok
    filler.unlink()
    ost.save(path, _tree(2), max_shard_size="2MB", overwrite=True)
    assert _same(ost.load(path), _tree(2))
    assert sorted(os.listdir(path)) == sorted(os.listdir(reference) + ["config.json"])


def test_a_consolidation_that_fills_the_disk_keeps_the_old_checkpoint(tmpfs, tmp_path):
    """``consolidate --overwrite`` onto a full disk: ENOSPC naming the file, the old checkpoint
    and the user's files as they were, nothing of ours left."""
    source = tmp_path / "distributed"
    ost.save(source, _tree(2), layout="distributed")
    path = tmpfs / "ckpt"
    ost.save(path, _tree(1), max_shard_size="2MB")
    (path / "config.json").write_text('{"mine": true}')
    filler = _fill(tmpfs, _pages(source) // 2)
    with pytest.raises(OSError) as raised:
        ost.consolidate(source, path, overwrite=True, max_shard_size="2MB")
    assert raised.value.errno == errno.ENOSPC and str(path) in raised.value.filename, raised.value
    assert _same(ost.load(path), _tree(1)) and ost.verify(path).ok
    assert not [n for n in os.listdir(path) if n.startswith(".")], os.listdir(path)
    assert (path / "config.json").read_text() == '{"mine": true}'
    filler.unlink()
    ost.consolidate(source, path, overwrite=True, max_shard_size="2MB")
    assert _same(ost.load(path), _tree(2))


def test_a_first_save_or_consolidation_that_fills_the_disk_leaves_no_directory(tmpfs, tmp_path):
    """Nothing was there: a failed save leaves nothing either, not an empty directory (nor
    the parents it made); a directory that was there before stays, empty or not."""
    source = tmp_path / "distributed"
    ost.save(source, _tree(2), layout="distributed")
    filler = _fill(tmpfs, 2 << 20)
    for path in (tmpfs / "new", tmpfs / "deeper" / "new"):
        with pytest.raises(OSError) as raised:
            ost.save(path, _tree(1), max_shard_size="2MB")
        assert raised.value.errno == errno.ENOSPC, raised.value
        with pytest.raises(OSError) as raised:
            ost.consolidate(source, path, max_shard_size="2MB")
        assert raised.value.errno == errno.ENOSPC, raised.value
        assert sorted(os.listdir(tmpfs)) == ["filler.bin"]
    (tmpfs / "mine").mkdir()
    with pytest.raises(OSError):
        ost.save(tmpfs / "mine", _tree(1), max_shard_size="2MB")
    assert sorted(os.listdir(tmpfs)) == ["filler.bin", "mine"] and os.listdir(tmpfs / "mine") == []
    filler.unlink()
    ost.save(tmpfs / "deeper" / "new", _tree(1), max_shard_size="2MB")
    assert _same(ost.load(tmpfs / "deeper" / "new"), _tree(1))


def test_a_conversion_to_orbax_that_fills_the_disk_is_enospc_and_leaves_nothing(tmpfs, tmp_path, caplog):
    """TensorStore reports a full disk as ``ValueError: RESOURCE_EXHAUSTED``, Orbax's threads
    log it with tracebacks, and Orbax stages its output under a name of its own
    (``.DST.tmp-TOKEN.orbax-checkpoint-tmp``), which was left behind and never removed."""
    source = tmp_path / "hf"
    tree = {f"layers.{i}.w": np.random.default_rng(i).standard_normal((256, 1024), np.float32)
            for i in range(4)}  # 4 MiB that Orbax's compression cannot shrink
    ost.save(source, tree)
    filler = _fill(tmpfs, 2 << 20)
    with pytest.raises(OSError) as raised:
        ost.convert(source, tmpfs / "orbax", progress=False)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(tmpfs / "orbax")
    assert "RESOURCE_EXHAUSTED" in str(raised.value.__cause__)
    assert not [r for r in caplog.records if r.exc_info], "tracebacks logged for the error raised"
    assert sorted(os.listdir(tmpfs)) == ["filler.bin"]
    filler.unlink()
    ost.convert(source, tmpfs / "orbax", progress=False)
    assert sorted(os.listdir(tmpfs)) == ["orbax"]
    ost.convert(tmpfs / "orbax", tmp_path / "back", progress=False)
    assert _same(ost.load(tmp_path / "back"), tree)
