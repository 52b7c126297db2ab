"""``ost.verify`` and ``orbax-safetensors verify``: every problem of a checkpoint, at once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import fsspec
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import orbax_safetensors as ost
from tests.support import REPO
from tests.support.multiprocess import run_multiprocess
from tests.format.test_format_malformed import CASES, Case

_REPO = str(REPO)
VALUES = {f"layer{i}.w": np.arange(64 * (i + 1), dtype=np.float32).reshape(8 * (i + 1), 8)
          for i in range(4)}
TOTAL = sum(v.nbytes for v in VALUES.values())


def _found(report: ost.VerifyReport) -> set[tuple[str | None, str | None]]:
    return {(p.file and os.path.basename(p.file), p.tensor) for p in report.problems}


def _sharded(tmp_path) -> str:
    path = tmp_path / "hf"
    ost.save(path, VALUES, max_shard_size=700)
    return os.fspath(path)


def save_distributed_child(args: dict) -> None:
    """In each of 2 processes × 4 devices: every tensor row-sharded over all 8 devices."""
    mesh = jax.make_mesh((8,), ("x",))
    tree = {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, P("x")), lambda i, v=v: v[i])
            for k, v in VALUES.items()}
    ost.save(args["path"], tree, layout="distributed")


@pytest.fixture(scope="module")
def distributed_checkpoint(tmp_path_factory) -> str:
    """A distributed-layout checkpoint as two processes write it: two files, two slices a tensor."""
    path = os.fspath(tmp_path_factory.mktemp("verify") / "dist")
    run_multiprocess("tests.engine.test_verify:save_distributed_child", num_processes=2,
                     args={"path": path})
    return path


@pytest.fixture
def _distributed(tmp_path, distributed_checkpoint):
    return lambda tmp: shutil.copytree(distributed_checkpoint, tmp / "dist")


@pytest.mark.parametrize("make, kind, files", [
    (lambda tmp: (ost.save(tmp / "one.safetensors", VALUES), tmp / "one.safetensors")[1], "single file", 1),
    (lambda tmp: (ost.save(tmp / "c", VALUES), tmp / "c")[1], "hf single file", 1),
    (_sharded, "hf sharded", 4),
    ("distributed", "distributed", 2),
])
def test_valid_checkpoints_verify_clean(tmp_path, make, kind, files, _distributed):
    report = ost.verify((_distributed if make == "distributed" else make)(tmp_path))
    assert report.ok, report.problems
    assert (report.kind, len(report.files), report.tensors, report.bytes) == (kind, files, 4, TOTAL)


def test_torch_dcp_style_directory_verifies_from_headers(tmp_path, _distributed):
    path = _distributed(tmp_path)
    os.remove(os.path.join(path, "orbax_safetensors.distributed.json"))
    report = ost.verify(path)
    assert report.ok and report.kind == "torch dcp" and report.bytes == TOTAL
    # Without an index a missing *last* slice is invisible (the shape comes from the extents);
    # a missing first one leaves a gap in every tensor.
    os.remove(os.path.join(path, sorted(os.listdir(path))[0]))
    report = ost.verify(path)
    assert {t for _, t in _found(report)} == set(VALUES)
    assert all("cover" in p.message for p in report.problems)


def test_every_problem_of_a_damaged_sharded_checkpoint_at_once(tmp_path):
    path = _sharded(tmp_path)
    shards = sorted(n for n in os.listdir(path) if n.startswith("model-"))
    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.loads(open(index_path).read())
    truncated = next(n for n, f in index["weight_map"].items() if f == shards[0])
    with open(os.path.join(path, shards[0]), "r+b") as f:  # truncated
        f.truncate(os.path.getsize(f.name) - 4)
    os.remove(os.path.join(path, shards[1]))  # missing
    held = next(n for n, f in index["weight_map"].items() if f == shards[2])
    ost.save(os.path.join(path, shards[2]), {held: VALUES[held], "extra": np.ones(2)},
             overwrite=True)  # holds a tensor the index does not list
    index["weight_map"]["ghost"] = shards[3]  # listed, not there
    open(index_path, "w").write(json.dumps(index))
    shutil.copy(os.path.join(path, shards[3]), os.path.join(path, "model-00009-of-00009.safetensors"))

    report = ost.verify(path)
    assert not report.ok
    # shards[2], rewritten, is also not the file whose crc32c the index lists.
    assert _found(report) == {
        (shards[0], None), (shards[1], None), (shards[2], "extra"), (shards[2], None),
        (shards[3], "ghost"),
    }, report.problems
    assert [os.path.basename(f) for f in report.leftovers] == ["model-00009-of-00009.safetensors"]
    messages = "\n".join(map(str, report.problems))
    for needle in ("does not exist", "is truncated", "does not hold it", "does not list",
                   "index lists crc32c"):
        assert needle in messages
    with pytest.raises(ost.SafetensorsError):  # a load stops at the first of them
        ost.load(path)


def test_total_size_and_second_copies_are_reported(tmp_path):
    """A stale ``total_size`` is tolerated (reported by verify only); a second copy of a tensor
    in another file the index names is an error of load and verify alike, naming both files:
    transformers reads every tensor of every file (the last copy wins), we the copy the index
    places, so two readers would load two models. (It was tolerated, load reading the index's
    copy while verify reported it; now they agree.)"""
    path = _sharded(tmp_path)
    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.loads(open(index_path).read())
    index["metadata"]["total_size"] = TOTAL + 1
    open(index_path, "w").write(json.dumps(index))
    shards = sorted(n for n in os.listdir(path) if n.startswith("model-"))
    first = next(n for n, f in index["weight_map"].items() if f == shards[0])
    ost.save(os.path.join(path, shards[1]), {first: VALUES[first], **{
        n: VALUES[n] for n, f in index["weight_map"].items() if f == shards[1]}}, overwrite=True)
    report = ost.verify(path)
    assert _found(report) == {("model.safetensors.index.json", None), (shards[1], first),
                              (shards[1], None)}  # and its crc32c is not the one the index lists
    second = next(p for p in report.problems if p.tensor == first)
    assert f"the index places this tensor in {shards[0]!r}" in second.message
    with pytest.raises(ost.SafetensorsError) as raised:
        ost.load(path)
    assert str(raised.value) == str(second)


def test_distributed_slices_checked_against_their_files(tmp_path, _distributed):
    path = _distributed(tmp_path)
    files = sorted(n for n in os.listdir(path) if n.startswith("shard-"))
    index_path = os.path.join(path, "orbax_safetensors.distributed.json")
    index = json.loads(open(index_path).read())
    entry = index["tensors"]["layer0.w"]
    entry["slices"][0]["offsets"], entry["slices"][1]["offsets"] = (
        entry["slices"][1]["offsets"], entry["slices"][0]["offsets"])  # swapped: DCP info disagrees
    open(index_path, "w").write(json.dumps(index))
    shutil.copy(os.path.join(path, files[1]), os.path.join(path, "shard-00003-model-00001-of-00001.safetensors"))
    report = ost.verify(path)
    assert _found(report) == {(f, "layer0.w") for f in files}, report.problems
    assert [os.path.basename(f) for f in report.leftovers] == [
        "shard-00003-model-00001-of-00001.safetensors"]
    assert sum("DCP_SHARDING_INFO" in p.message for p in report.problems) == 2
    with pytest.raises(ost.SafetensorsError, match="DCP_SHARDING_INFO puts this slice at"):
        ost.load(path)  # equal-shaped halves: trusting the index alone would load them swapped


def test_an_index_naming_a_directory_is_an_error_not_a_crash(tmp_path):
    path = _sharded(tmp_path)
    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.loads(open(index_path).read())
    index["weight_map"]["layer0.w"] = "sub.safetensors"
    os.mkdir(os.path.join(path, "sub.safetensors"))
    open(index_path, "w").write(json.dumps(index))
    with pytest.raises(ost.SafetensorsError, match="is a directory"):
        ost.load(path)
    assert [(os.path.basename(p.file), p.message) for p in ost.verify(path).problems] == [
        ("sub.safetensors", "is a directory, not a safetensors file")]


def test_an_oversized_index_is_refused_before_it_is_read(tmp_path, monkeypatch):
    from orbax_safetensors.engine.core import catalog
    from orbax_safetensors.storage import LocalStorage
    path = _sharded(tmp_path)
    monkeypatch.setattr(catalog, "MAX_INDEX_SIZE", 100)
    read = []
    monkeypatch.setattr(LocalStorage, "read",
                        lambda self, *a: read.append(a) or b"")
    with pytest.raises(ost.SafetensorsError, match="over the 100-byte limit"):
        ost.load(path)
    assert "over the 100-byte limit" in ost.verify(path).problems[0].message
    assert read == []


def test_a_broken_index_is_one_problem(tmp_path, _distributed):
    path = _distributed(tmp_path)
    with open(os.path.join(path, "orbax_safetensors.distributed.json"), "w") as f:
        f.write("{")
    report = ost.verify(path)
    assert len(report.problems) == 1 and "malformed" in report.problems[0].message


MALFORMED = [c for c in CASES if c.rust is None or c.rust == "reject"]


@pytest.mark.parametrize("case", MALFORMED, ids=[c.id for c in MALFORMED])
def test_verify_reports_what_load_rejects(tmp_path, case: Case):
    """Every malformed file and index of the rejection table is a problem naming the same file."""
    path = case.make(tmp_path)
    report = ost.verify(path)
    assert not report.ok
    named = os.fspath(path if case.names_file is None else tmp_path / case.names_file)
    assert any(p.file == named or (p.file and named.endswith(p.file)) for p in report.problems), \
        (named, report.problems)


def test_missing_path_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        ost.verify(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError):
        ost.verify(tmp_path / "nothing.safetensors")


def test_verify_through_fsspec(tmp_path):
    fs = fsspec.filesystem("memory")
    url = "memory://verify-test/ckpt"
    ost.save(url, VALUES, max_shard_size=700)
    assert ost.verify(url).ok
    shard = sorted(p for p in fs.ls("/verify-test/ckpt", detail=False) if "model-" in p)[0]
    fs.pipe_file(shard, fs.cat_file(shard)[:-1])
    report = ost.verify(url)
    assert [os.path.basename(p.file) for p in report.problems] == [os.path.basename(shard)]
    fs.rm("/verify-test", recursive=True)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "orbax_safetensors.integrations.cli", *args],
                          capture_output=True, text=True, timeout=120, cwd=_REPO)


def test_cli_verify(tmp_path):
    path = _sharded(tmp_path)
    ok = _cli("verify", path)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "ok: hf sharded, 4 file(s), 4 tensors, 2.56 KB"
    shards = sorted(n for n in os.listdir(path) if n.startswith("model-"))
    shutil.copy(os.path.join(path, shards[0]), os.path.join(path, "model-00001-of-00009.safetensors"))
    noted = _cli("verify", path)
    assert noted.returncode == 0 and noted.stdout.startswith("note: file ")
    assert "model-00001-of-00009.safetensors" in noted.stdout.splitlines()[0]
    os.remove(os.path.join(path, "model-00001-of-00009.safetensors"))
    os.remove(os.path.join(path, shards[0]))
    with open(os.path.join(path, shards[1]), "r+b") as f:
        f.truncate(100)
    bad = _cli("verify", path)
    assert bad.returncode == 1
    lines = bad.stdout.strip().splitlines()
    assert len(lines) == 3 and lines[-1].startswith("2 problems: hf sharded")
    assert shards[0] in lines[0] + lines[1] and shards[1] in lines[0] + lines[1]
    report = json.loads(_cli("verify", path, "--json").stdout)
    assert report["ok"] is False and len(report["problems"]) == 2
    assert {os.path.basename(p["file"]) for p in report["problems"]} == set(shards[:2])
    missing = _cli("verify", os.fspath(tmp_path / "absent"))
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1


def test_a_whole_float_total_size_is_accepted_and_others_reported(tmp_path):
    """transformers wrote ``"total_size": 1234.0`` in some versions: fine for verify and load
    alike; a fractional or negative total is a problem verify reports (load never reads it)."""
    path = _sharded(tmp_path)
    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.loads(open(index_path).read())
    for total, ok in ((float(TOTAL), True), (TOTAL + 0.5, False), (-TOTAL, False),
                      (-float(TOTAL), False)):
        index["metadata"]["total_size"] = total
        open(index_path, "w").write(json.dumps(index))
        assert f'"total_size": {total}' in open(index_path).read()  # e.g. 2560.0, not 2560
        report = ost.verify(path)
        assert report.ok is ok, (total, report.problems)
        if not ok:
            assert [(p.file and os.path.basename(p.file), p.message) for p in report.problems] == [
                ("model.safetensors.index.json",
                 f"metadata.total_size is {total!r}, but the tensors hold {TOTAL} bytes")]
        restored = ost.load(path)
        assert sorted(restored) == sorted(VALUES)
        np.testing.assert_array_equal(restored["layer3.w"], VALUES["layer3.w"])
