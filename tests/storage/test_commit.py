"""The commit protocol through the public API: replacing damaged checkpoints, what verify lists,
what a reader sees while a commit is open or after its writer died in it, snapshot reads on
``memory://``, and errors that keep their type."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import orbax_safetensors as ost
from orbax_safetensors.storage import commit as commit_module
from tests.support.overwriter import overwriting
from orbax_safetensors.storage import local as local_storage

USER_FILES = {"config.json": b'{"model_type": "llama"}', "README.md": b"# mine",
              "notes/x.txt": b"keep me"}


def _tree(value: float, n: int = 4) -> dict[str, np.ndarray]:
    return {f"layer{i}.w": np.full((64, 32), value + i, np.float32) for i in range(n)}


def _same(loaded: dict, expected: dict) -> bool:
    return sorted(loaded) == sorted(expected) and all(
        np.array_equal(loaded[k], expected[k]) for k in expected)


def _with_user_files(path) -> None:
    for name, data in USER_FILES.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)


def _user_files_intact(path) -> bool:
    return all((path / n).read_bytes() == data for n, data in USER_FILES.items())


def _hidden(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("."))


@pytest.mark.parametrize("damage", [b"", b"{not json", b'{"weight_map": 3}'])
def test_overwrite_replaces_a_checkpoint_whose_index_is_damaged(tmp_path, damage):
    path = tmp_path / "ckpt"
    ost.save(path, _tree(1), max_shard_size=20000)
    _with_user_files(path)
    (path / "model.safetensors.index.json").write_bytes(damage)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        ost.save(path, _tree(2), max_shard_size=20000)
    ost.save(path, _tree(2), max_shard_size=50000, overwrite=True)
    assert _same(ost.load(path), _tree(2))
    assert _user_files_intact(path) and not _hidden(path)
    assert ost.verify(path).ok and not ost.verify(path).leftovers


def test_verify_lists_leftover_temporaries_and_the_next_save_removes_them(tmp_path):
    path = tmp_path / "ckpt"
    ost.save(path, _tree(1))
    debris = [".model.safetensors.tmp-0123456789ab", ".model-00001-of-00002.safetensors.part-"
              "0123456789ab-00000000000000000000", ".model.safetensors.old-0123456789ab"]
    for name in debris:
        (path / name).write_bytes(b"x" * 100)
    report = ost.verify(path)
    assert report.ok
    assert sorted(os.path.basename(p) for p in report.leftovers) == sorted(debris)
    ost.save(path, _tree(2), overwrite=True)
    assert not _hidden(path)


@pytest.mark.parametrize("layout, index", [("hf", "model.safetensors.index.json"),
                                           ("distributed", "orbax_safetensors.distributed.json")])
def test_an_overwrite_moves_the_old_index_away_before_any_file_changes(tmp_path, monkeypatch,
                                                                     layout, index):
    """A reader that knows no journal (transformers) must never find the old index beside new
    files: the catalog names the old checkpoint's index, and the commit moves it first."""
    path = tmp_path / "ckpt"
    ost.save(path, _tree(1), layout=layout, max_shard_size=20000)
    renames = []
    rename = local_storage.LocalStorage.rename

    def recording(self, source, destination, **options):
        renames.append((os.path.basename(source), os.path.basename(destination)))
        return rename(self, source, destination, **options)

    monkeypatch.setattr(local_storage.LocalStorage, "rename", recording)
    ost.save(path, _tree(2), layout=layout, max_shard_size=20000, overwrite=True)
    moves = [(a, b) for a, b in renames if ".orbax_safetensors.commit-" not in b]
    assert moves[0][0] == index and moves[0][1].startswith(f".{index}.old-"), moves
    assert moves[-1][1] == index, moves  # and the new index is put in place last
    assert _same(ost.load(path), _tree(2))


def _interrupted_commit(tmp_path, dies_at: str):
    """A sharded checkpoint being overwritten whose writer dies (no rollback, as under SIGKILL)
    in its commit: right after writing the journal (``"journal written"``), or right before
    removing it, the commit point, with every new file already in place (``"commit point"``).
    Returns (path, old tree, new tree)."""
    path = tmp_path / "ckpt"
    old, new = _tree(1), _tree(2, n=5)
    ost.save(path, old, max_shard_size=20000)
    _with_user_files(path)

    class Died(BaseException):
        pass

    def is_journal(p) -> bool:
        return ".orbax_safetensors.commit-" in str(p) and ".tmp-" not in str(p)

    rename, remove = local_storage.LocalStorage.rename, local_storage.LocalStorage.remove

    def renaming(self, source, destination, **options):
        if dies_at == "journal written" and is_journal(source) is False and any(
                is_journal(os.path.join(path, n)) for n in os.listdir(path)):
            raise Died
        return rename(self, source, destination, **options)

    def removing(self, target):
        if dies_at == "commit point" and is_journal(target):
            raise Died
        return remove(self, target)

    roll_back = commit_module.StagedCommit._roll_back
    try:
        local_storage.LocalStorage.rename, local_storage.LocalStorage.remove = renaming, removing
        commit_module.StagedCommit._roll_back = lambda self, journal: None
        with pytest.raises(Died):
            ost.save(path, new, max_shard_size=30000, overwrite=True)
    finally:
        local_storage.LocalStorage.rename, local_storage.LocalStorage.remove = rename, remove
        commit_module.StagedCommit._roll_back = roll_back
    return path, old, new


@pytest.mark.parametrize("dies_at", ["journal written", "commit point"])
def test_a_commit_its_writer_died_in_still_loads_the_old_checkpoint_and_is_rolled_back(
        tmp_path, dies_at):
    path, old, new = _interrupted_commit(tmp_path, dies_at)
    assert any(n.startswith(".orbax_safetensors.commit-") for n in os.listdir(path))
    assert _same(ost.load(path), old)
    assert ost.verify(path).ok
    assert sorted(ost.metadata(path).tensors) == sorted(old)
    with pytest.raises(FileExistsError):  # the old checkpoint is the committed one
        ost.save(path, new, overwrite=False)
    ost.save(path, new, max_shard_size=30000, overwrite=True)
    assert _same(ost.load(path), new)
    assert _user_files_intact(path) and not _hidden(path)


def test_loads_on_memory_fs_see_one_checkpoint_while_another_thread_overwrites(tmp_path):
    """``memory://`` cannot pin a file: a load that read a file replaced meanwhile reads again."""
    url = f"memory://snapshot-{os.getpid()}/ckpt"
    versions = [_tree(1), _tree(2)]
    ost.save(url, versions[0], max_shard_size=20000)
    seen = {0: 0, 1: 0}
    # a training loop saves now and then, not back to back
    with overwriting(url, versions, pause=0.01, max_shard_size=20000) as errors:
        for _ in range(150):
            loaded = ost.load(url)
            matches = [i for i, v in enumerate(versions) if _same(loaded, v)]
            assert matches, "a load mixed two checkpoints"
            seen[matches[0]] += 1
    assert not errors, errors
    assert seen[0] and seen[1], seen


@pytest.mark.parametrize("persistent", [False, True])
def test_a_failed_save_raises_the_original_error_with_its_errno_and_file(
        tmp_path, monkeypatch, persistent):
    """ENOSPC renaming the new index in. Once: the commit rolls back and leaves nothing. Every
    time (the rollback's own rename back fails too): the old checkpoint still loads, through the
    journal, and the next save finishes the rollback."""
    path = tmp_path / "ckpt"
    ost.save(path, _tree(1), max_shard_size=20000)
    original = local_storage.LocalStorage.rename
    failures = []

    def no_space(self, source, destination, **options):
        if destination.endswith(".index.json") and (persistent or not failures):
            failures.append(destination)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), destination)
        return original(self, source, destination, **options)

    monkeypatch.setattr(local_storage.LocalStorage, "rename", no_space)
    with pytest.raises(OSError) as raised:
        ost.save(path, _tree(2), max_shard_size=20000, overwrite=True)
    assert type(raised.value) is OSError and raised.value.errno == errno.ENOSPC
    assert raised.value.filename.endswith("model.safetensors.index.json")
    monkeypatch.undo()
    assert _same(ost.load(path), _tree(1))
    assert ost.verify(path).ok
    assert bool(_hidden(path)) == persistent
    ost.save(path, _tree(3), max_shard_size=20000, overwrite=True)
    assert _same(ost.load(path), _tree(3)) and not _hidden(path)


def test_os_errors_name_their_file(tmp_path, monkeypatch):
    """``os`` calls on descriptors report ENOSPC without a file name; the error that reaches the
    caller has it."""
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(local_storage.os, "posix_fallocate", full)
    with pytest.raises(OSError) as raised:
        ost.save(tmp_path / "x.safetensors", _tree(1))
    assert raised.value.errno == errno.ENOSPC and "x.safetensors" in raised.value.filename
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == []


def test_the_journal_is_json_naming_old_and_new_files(tmp_path):
    """What a reader relies on while a commit is open (see docs/concepts.md)."""
    path, old, _ = _interrupted_commit(tmp_path, "commit point")
    journal = next(n for n in os.listdir(path) if n.startswith(".orbax_safetensors.commit-"))
    content = json.loads((path / journal).read_text())
    assert set(content) == {"token", "old", "new", "replaced"}
    assert content["new"][-1] == "model.safetensors.index.json"
    assert "model.safetensors.index.json" in content["old"]


def test_a_second_writer_fails_fast_naming_the_path_and_the_holder(tmp_path):
    """Two saves of one directory from two threads: the second fails at once, the first
    commits whole, nobody's temporaries are removed under it."""
    path = tmp_path / "ckpt"
    big = {f"t{i}": np.full(4 << 20, i, np.float32) for i in range(8)}  # 128 MB: a slow save
    first = ost.async_save(path, big, max_shard_size="40MB")
    started = time.monotonic()
    with pytest.raises(ost.CheckpointBusyError) as raised:
        ost.save(path, _tree(2), overwrite=True)
    assert time.monotonic() - started < 1.0
    assert raised.value.errno == errno.EBUSY and raised.value.filename.startswith(str(path))
    assert f"pid {os.getpid()}" in str(raised.value) and "another save" in str(raised.value)
    first.result()
    loaded = ost.load(path)
    assert sorted(loaded) == sorted(big) and all(np.array_equal(loaded[k], big[k]) for k in big)
    assert not _hidden(path)
    ost.save(path, _tree(2), overwrite=True)  # the lock is free again
    assert _same(ost.load(path), _tree(2))


def test_a_dead_writers_lock_and_debris_do_not_block_the_next_save(tmp_path):
    """A writer SIGKILLed mid-save leaves its lock file and temporaries; the kernel dropped its
    lock, so the next save goes ahead and removes what it left."""
    path = tmp_path / "ckpt"
    ost.save(path, _tree(1))
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, numpy as np, orbax_safetensors as ost\n"
        "from orbax_safetensors.storage.local import LocalStorage\n"
        "real = LocalStorage.write_at\n"
        "def hang(self, *a):\n"
        "    real(self, *a); print('hanging', flush=True); import time; time.sleep(600)\n"
        "LocalStorage.write_at = hang\n"
        "ost.save(sys.argv[1], {'w': np.ones(1 << 20, np.float32)}, overwrite=True)\n"), str(path)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        assert child.stdout.readline().strip() == "hanging"
        with pytest.raises(ost.CheckpointBusyError, match=f"pid {child.pid} "):
            ost.save(path, _tree(2), overwrite=True)
    finally:
        child.kill()
        child.wait()
    assert _hidden(path)  # its lock file and temporary
    assert _same(ost.load(path), _tree(1))
    ost.save(path, _tree(2), overwrite=True)
    assert _same(ost.load(path), _tree(2)) and not _hidden(path)


def test_saves_of_two_files_in_one_directory_do_not_touch_each_other(tmp_path):
    trees = {"x.safetensors": _tree(1), "y.safetensors": _tree(2)}
    futures = [ost.async_save(tmp_path / name, tree) for name, tree in trees.items()]
    for future in futures:
        future.result()
    for name, tree in trees.items():
        assert _same(ost.load(tmp_path / name), tree)
    assert sorted(os.listdir(tmp_path)) == sorted(trees)


@pytest.mark.parametrize("files", [
    ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"],  # hf download --include
    ["model-00001-of-00003.safetensors"],  # a stale shard, beside what a 2-shard save would write
], ids=["shards-without-index", "stale-shard"])
@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_save_without_overwrite_never_removes_files_it_did_not_write(tmp_path, files, where):
    """Shard files with no index are not debris of ours (those are temporaries, or files a
    marker lists): a save without overwrite refuses them by name and leaves every byte."""
    import fsspec

    url = str(tmp_path / "ckpt") if where == "local" else f"memory://{tmp_path.name}/ckpt"
    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(root, exist_ok=True)
    for name in files:
        fs.pipe_file(f"{root}/{name}", b"important " + name.encode())
    with pytest.raises(FileExistsError, match="overwrite=True") as raised:
        ost.save(url, _tree(1.0), max_shard_size=20_000)
    assert raised.value.errno == errno.EEXIST
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(root, detail=False)) == sorted(files)
    assert all(fs.cat_file(f"{root}/{name}") == b"important " + name.encode() for name in files)
    ost.save(url, _tree(1.0), max_shard_size=20_000, overwrite=True)  # asked: they are replaced
    assert _same(ost.load(url), _tree(1.0))
    written = {f for names in ost.metadata(url).files.values() for f in names} | {"model.safetensors.index.json"}
    assert {p.rsplit("/", 1)[1] for p in fs.ls(root, detail=False)} == written  # no old shard beside
    if where == "memory":
        fs.rm(root, recursive=True)
