"""A directory of ``*.safetensors`` files and no index: a checkpoint of every one of them.

What Orbax's ``SafetensorsLayout`` loads (every ``*.safetensors`` of the directory, a name
stored twice refused), and what ``hf download --include '*.safetensors'`` or a writer
without an index (``safetensors.torch.save_file`` per part) leaves. ``load``, ``metadata``,
``verify``, the CLI and a save's overwrite check all ask the catalog, so they agree on it:
HF-named shards only as the whole set 1..N, no tensor in two files (naming both), a torch
DCP directory keeps its own kind, and the marker of a save in progress keeps a directory
an interrupted save.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

import orbax_safetensors as ost

PARTS = {
    "part1.safetensors": {"a": np.arange(6, dtype=np.float32).reshape(2, 3),
                          "c": np.array([5, 6], dtype=np.int32)},
    "part2.safetensors": {"b": np.linspace(-1, 1, 4, dtype=np.float64),
                          "d": np.array([True, False])},
}


def _write(directory, parts=PARTS):
    os.makedirs(directory, exist_ok=True)
    for name, tensors in parts.items():
        save_file(tensors, os.path.join(directory, name))
    return os.fspath(directory)


def _same(loaded, expected):
    assert sorted(loaded) == sorted(expected)
    for name, value in expected.items():
        assert loaded[name].dtype == value.dtype and loaded[name].shape == value.shape, name
        assert loaded[name].tobytes() == value.tobytes(), name


def test_every_file_loads_and_every_reader_agrees(tmp_path):
    path = _write(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").write_text("{}")  # not a safetensors file: not read
    expected = {k: v for tensors in PARTS.values() for k, v in tensors.items()}
    _same(ost.load(path), expected)
    info = ost.metadata(path)
    assert info.files == {"a": ("part1.safetensors",), "b": ("part2.safetensors",),
                          "c": ("part1.safetensors",), "d": ("part2.safetensors",)}
    report = ost.verify(path)
    assert report.ok, report.problems
    assert (report.kind, [os.path.basename(f) for f in report.files]) == (
        "safetensors files (no index)", ["part1.safetensors", "part2.safetensors"])
    cli = subprocess.run([sys.executable, "-m", "orbax_safetensors.integrations.cli", "verify", path],
                         capture_output=True, text=True, check=False)
    assert cli.returncode == 0 and "ok: safetensors files (no index), 2 file(s), 4 tensors" in cli.stdout


def test_a_whole_set_of_hf_shards_without_index_loads_and_a_gap_does_not(tmp_path):
    tensors = {f"w{i}": np.full((4,), i, np.float32) for i in range(3)}
    path = _write(tmp_path / "ckpt", {f"model-0000{i + 1}-of-00003.safetensors": {f"w{i}": tensors[f"w{i}"]}
                                      for i in range(3)})
    _same(ost.load(path), tensors)
    os.remove(os.path.join(path, "model-00002-of-00003.safetensors"))
    expected = ("holds shards of 3 (model-*-of-00003.safetensors) but not "
                "model-00002-of-00003.safetensors, and no model.safetensors.index.json")
    for read in (ost.load, ost.metadata):
        with pytest.raises(ost.SafetensorsError, match=re.escape(expected)):
            read(path)
    assert [p.message.split(":")[0] for p in ost.verify(path).problems] == [expected]
    with pytest.raises(FileExistsError, match="no save of ours wrote and no index names"):
        ost.save(path, tensors)  # no checkpoint, but not ours to remove either


def test_a_name_stored_in_two_files_is_refused_naming_both(tmp_path):
    """Orbax refuses it too ("Duplicate tensor a found in multiple files"); transformers would
    take the last file's copy, our load and verify agree that neither is the tensor."""
    path = _write(tmp_path / "ckpt")
    save_file({"a": np.zeros((2, 3), np.float32)}, os.path.join(path, "part3.safetensors"))
    with pytest.raises(ost.SafetensorsError) as raised:
        ost.load(path)
    message = str(raised.value)
    assert "part1.safetensors" in message and "part3.safetensors" in message and "tensor 'a'" in message
    with pytest.raises(ost.SafetensorsError, match="stored twice"):
        ost.metadata(path)
    (problem,) = ost.verify(path).problems
    assert str(problem) == message


def test_a_save_refuses_the_directory_without_overwrite_and_replaces_only_its_files(tmp_path):
    """The files are a committed checkpoint now: a save without overwrite refuses it; with
    overwrite every one of them is replaced (a reader globbing ``*.safetensors`` must not find
    them beside the new files), and other files stay."""
    path = _write(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    new = {"x": np.arange(3, dtype=np.float32)}
    with pytest.raises(FileExistsError, match="overwrite=True"):
        ost.save(path, new)
    ost.save(path, new, overwrite=True)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]
    _same(ost.load(path), new)


def test_the_marker_of_a_save_in_progress_keeps_it_an_interrupted_save(tmp_path):
    """On object stores a save writes its files under their final names after removing the old
    index: its marker, put down first, is what keeps a load racing it from reading the files
    there as a checkpoint without index (half old, half new)."""
    path = _write(tmp_path / "ckpt")
    marker = tmp_path / "ckpt" / ".orbax_safetensors.writing-0123456789ab.json"
    marker.write_text(json.dumps({"files": ["model-00001-of-00002.safetensors"]}))
    with pytest.raises(ost.SafetensorsError, match="interrupted save"):
        ost.load(path)
    assert "interrupted save" in str(ost.verify(path).problems)
    marker.unlink()
    assert ost.verify(path).ok


def test_torch_dcp_files_keep_their_kind_and_are_not_mixed_with_others(tmp_path):
    """``shard-*-model-*`` files are slices (torch DCP): their own kind of checkpoint, never whole tensors;
    beside other safetensors files and no index, which is the checkpoint is not ours to guess."""
    tree = {"w": np.arange(16, dtype=np.float32).reshape(4, 4)}
    path = tmp_path / "dist"
    ost.save(path, tree, layout="distributed")
    os.remove(path / "orbax_safetensors.distributed.json")
    assert ost.verify(path).kind == "torch dcp"
    _same(ost.load(path), tree)
    save_file({"v": np.zeros(2, np.float32)}, os.fspath(path / "extra.safetensors"))
    with pytest.raises(ost.SafetensorsError, match="torch DCP slice files"):
        ost.load(path)
