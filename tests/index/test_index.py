"""The Hugging Face checkpoint layout: shard files, the index, sizes, overwrite.

What transformers' ``save_pretrained`` writes, and what we must write too:

* one ``model.safetensors`` when everything fits under ``max_shard_size``;
* otherwise ``model-0000i-of-0000N.safetensors`` plus
  ``model.safetensors.index.json``, whose bytes are
  ``json.dumps({"metadata": {"total_size": N}, "weight_map": {...}},
  indent=2, sort_keys=True) + "\\n"``, ``total_size`` being the sum of the
  tensors' bytes (headers not counted);
* tensors packed into files by huggingface_hub's greedy rule
  (``split_state_dict_into_shards_factory``), re-implemented below. That rule
  counts tensor bytes only; ours also counts each tensor's header entry and the
  file's header, so that no file exceeds the limit (``tests/engine/test_user_surface.py``).
  The sizes and limits here leave room for the headers (no tensor or group
  fills a limit to within its header's bytes), where both rules agree.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import safetensors

import orbax_safetensors as ost
from orbax_safetensors import SafetensorsError
from orbax_safetensors.index import parse_size
from orbax_safetensors.storage import local as local_storage
from tests.support.hf_reference import reference_split

INDEX = "model.safetensors.index.json"


def make_tree(sizes_in_floats: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(n).astype(np.float32) for name, n in sizes_in_floats.items()}


def shard_names(count: int) -> list[str]:
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def assert_same_tree(loaded: dict, tree: dict) -> None:
    assert set(loaded) == set(tree)
    for name, value in tree.items():
        assert loaded[name].dtype == value.dtype
        assert loaded[name].tobytes() == value.tobytes(), name


# Names sort in the order written (a dict flattens in sorted-key order).
TREE_FLOATS = {"a.weight": 10_000, "b.weight": 10_000, "c.big": 25_000, "d.bias": 6_000, "e.bias": 2_000}
LIMIT = 65_000  # bytes: a=40 000 b=40 000 c=100 000 (over the limit) d=24 000 e=8 000


def test_sharded_save_layout_and_index_bytes(tmp_path):
    tree = make_tree(TREE_FLOATS)
    ckpt = tmp_path / "ckpt"
    # Without checksums, exactly what transformers' save_pretrained writes.
    ost.save(ckpt, tree, max_shard_size=LIMIT, metadata={"framework": "jax"}, checksums=False)

    sizes = [(name, tree[name].nbytes) for name in sorted(tree)]
    groups = reference_split(sizes, LIMIT)
    # Worked by hand: [a], then c alone (too big, the open shard [b] stays open),
    # then b+d = 64 000 fits (with room for their headers), then e would make 72 000.
    assert groups == [["a.weight"], ["c.big"], ["b.weight", "d.bias"], ["e.bias"]]
    files = shard_names(len(groups))
    assert sorted(os.listdir(ckpt)) == sorted(files + [INDEX])

    weight_map = {name: files[i] for i, group in enumerate(groups) for name in group}
    expected_index = (
        json.dumps(
            {"metadata": {"total_size": sum(s for _, s in sizes)}, "weight_map": weight_map},
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )
    assert (ckpt / INDEX).read_bytes() == expected_index.encode()
    assert json.loads((ckpt / INDEX).read_text())["metadata"]["total_size"] == 4 * 53_000

    for file, group in zip(files, groups):
        content = (ckpt / file).read_bytes()
        raw = dict(safetensors.deserialize(content))  # the crate reads every shard
        assert set(raw) == set(group)
        for name in group:
            assert bytes(raw[name]["data"]) == tree[name].tobytes()
        with safetensors.safe_open(ckpt / file, framework="numpy") as f:
            assert f.metadata() == {"format": "pt", "framework": "jax"}

    assert_same_tree(ost.load(ckpt), tree)
    meta = ost.metadata(ckpt)
    assert meta.files == {name: (file,) for name, file in weight_map.items()}
    assert meta.metadata == {"format": "pt", "framework": "jax"}
    assert {n: (s.shape, s.dtype) for n, s in meta.tensors.items()} == {
        n: (v.shape, v.dtype) for n, v in tree.items()
    }


@pytest.mark.parametrize("limit", [1, 39_000, 41_000, 81_000, 101_000, 199_000, 211_000, 213_000,
                                   "101KB", "0.15MB"])
def test_packing_follows_the_huggingface_hub_rule(tmp_path, limit):
    tree = make_tree(TREE_FLOATS, seed=1)
    ckpt = tmp_path / "ckpt"
    ost.save(ckpt, tree, max_shard_size=limit)
    groups = reference_split([(n, tree[n].nbytes) for n in sorted(tree)], parse_size(limit))
    if len(groups) == 1:
        assert sorted(os.listdir(ckpt)) == ["model.safetensors"]
    else:
        index = json.loads((ckpt / INDEX).read_text())
        files = shard_names(len(groups))
        assert index["weight_map"] == {
            name: files[i] for i, group in enumerate(groups) for name in group
        }
        assert sorted(os.listdir(ckpt)) == sorted(files + [INDEX])
    assert_same_tree(ost.load(ckpt), tree)


def test_tensor_bigger_than_the_limit_is_alone_in_its_file(tmp_path):
    tree = {
        "big": np.zeros(5000, np.uint8),
        "small1": np.ones(10, np.uint8),
        "small2": np.ones(10, np.uint8),
    }
    ckpt = tmp_path / "ckpt"
    ost.save(ckpt, tree, max_shard_size=1000)
    weight_map = json.loads((ckpt / INDEX).read_text())["weight_map"]
    big_file = weight_map["big"]
    assert [n for n, f in weight_map.items() if f == big_file] == ["big"]
    assert weight_map["small1"] == weight_map["small2"] != big_file
    assert (ckpt / big_file).stat().st_size > 5000
    assert_same_tree(ost.load(ckpt), tree)


def test_everything_fits_one_file_means_model_safetensors_and_no_index(tmp_path):
    tree = make_tree(TREE_FLOATS)
    ckpt = tmp_path / "ckpt"
    ost.save(ckpt, tree)  # default 5GB
    assert os.listdir(ckpt) == ["model.safetensors"]
    with safetensors.safe_open(ckpt / "model.safetensors", framework="numpy") as f:
        assert set(f.keys()) == set(tree)
        assert f.metadata()["format"] == "pt"
        assert set(f.metadata()) == {"format", "orbax_safetensors.crc32c",
                                     "orbax_safetensors.crc32c_block_bytes"}
    assert_same_tree(ost.load(ckpt), tree)
    # A limit the whole file meets (and a little over) is one file; one the tensor bytes alone
    # fill is not: headers count.
    size = (ckpt / "model.safetensors").stat().st_size
    ost.save(tmp_path / "fits", tree, max_shard_size=size + 256)
    assert os.listdir(tmp_path / "fits") == ["model.safetensors"]
    ost.save(tmp_path / "data", tree, max_shard_size=sum(v.nbytes for v in tree.values()))
    assert INDEX in os.listdir(tmp_path / "data")


def test_a_sub_byte_tensor_counts_its_packed_size(tmp_path):
    import ml_dtypes

    tree = {"q": np.zeros(64, ml_dtypes.float4_e2m1fn), "r": np.zeros(8, np.float32)}
    ckpt = tmp_path / "ckpt"
    ost.save(ckpt, tree, max_shard_size=32)  # q is 32 bytes packed, r is 32
    index = json.loads((ckpt / INDEX).read_text())
    assert index["metadata"]["total_size"] == 64
    assert index["weight_map"] == dict(zip(["q", "r"], shard_names(2)))


# --------------------------------------------------------------------------- unlisted files


def test_files_the_index_does_not_name_are_never_opened(tmp_path, monkeypatch):
    tree = make_tree(TREE_FLOATS)
    ckpt = tmp_path / "ckpt"
    ost.save(ckpt, tree, max_shard_size=LIMIT)
    named = set(json.loads((ckpt / INDEX).read_text())["weight_map"].values())
    # Garbage that fails to parse if anyone opens it as a safetensors file.
    strays = {
        "model-00009-of-00009.safetensors": b"\xff" * 8 + b"not a safetensors file",
        "model.safetensors": b"\x00" * 3,
        "config.json": b'{"architectures": ["Whatever"]}',
        "README.md": b"# hello",
    }
    for name, content in strays.items():
        (ckpt / name).write_bytes(content)

    touched: set[str] = set()
    original = local_storage._open_regular  # every read of a local file opens it here

    def spy(path):
        touched.add(os.path.basename(path))
        return original(path)

    monkeypatch.setattr(local_storage, "_open_regular", spy)

    assert_same_tree(ost.load(ckpt), tree)
    meta = ost.metadata(ckpt)
    assert {f for fs in meta.files.values() for f in fs} == named
    assert touched == named | {INDEX}
    assert not touched & set(strays)


# --------------------------------------------------------------------------- parse_size


@pytest.mark.parametrize(
    "size, expected",
    [
        (1, 1),
        (123456, 123456),
        (5 * 10**9, 5 * 10**9),
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("2GiB", 2 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("10KB", 10_000),
        ("10KiB", 10_240),
        ("3MiB", 3 * 2**20),
        ("1TB", 10**12),
        ("100", 100),
        ("64B", 64),
        (" 5 GB ", 5 * 10**9),
    ],
)
def test_parse_size_accepts(size, expected):
    assert parse_size(size) == expected


@pytest.mark.parametrize(
    "size", ["", "5XB", "GB", "5 G B", "-1GB", "1e3MB", "five", -1, 0, "0GB", True, False]
)
def test_parse_size_rejects(size):
    with pytest.raises(ValueError):
        parse_size(size)


def test_save_rejects_an_invalid_max_shard_size(tmp_path):
    with pytest.raises(ValueError, match="5XB"):
        ost.save(tmp_path / "ckpt", make_tree(TREE_FLOATS), max_shard_size="5XB")
    assert not (tmp_path / "ckpt").exists() or not os.listdir(tmp_path / "ckpt")


# --------------------------------------------------------------------------- overwrite


def test_save_refuses_to_overwrite_a_directory_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = make_tree(TREE_FLOATS, seed=1)
    ost.save(ckpt, first, max_shard_size=LIMIT)
    before = {name: (ckpt / name).read_bytes() for name in os.listdir(ckpt)}
    for limit in (LIMIT, "5GB"):  # the same layout, or one that would write other files
        with pytest.raises(FileExistsError):
            ost.save(ckpt, make_tree(TREE_FLOATS, seed=2), max_shard_size=limit)
    assert {name: (ckpt / name).read_bytes() for name in os.listdir(ckpt)} == before
    assert_same_tree(ost.load(ckpt), first)

    second = make_tree(TREE_FLOATS, seed=2)
    ost.save(ckpt, second, max_shard_size=LIMIT, overwrite=True)
    assert_same_tree(ost.load(ckpt), second)


def test_save_refuses_to_overwrite_a_single_file(tmp_path):
    path = tmp_path / "weights.safetensors"
    first = make_tree(TREE_FLOATS, seed=1)
    ost.save(path, first)
    with pytest.raises(FileExistsError):
        ost.save(path, make_tree(TREE_FLOATS, seed=2))
    assert_same_tree(ost.load(path), first)
    second = {"only": np.arange(3, dtype=np.int64)}
    ost.save(path, second, overwrite=True)
    assert_same_tree(ost.load(path), second)
    assert os.listdir(tmp_path) == ["weights.safetensors"]  # no temporary left behind


def test_save_refuses_to_overwrite_a_single_file_checkpoint_directory(tmp_path):
    ckpt = tmp_path / "ckpt"
    ost.save(ckpt, make_tree(TREE_FLOATS, seed=1))
    with pytest.raises(FileExistsError):
        ost.save(ckpt, make_tree(TREE_FLOATS, seed=2), max_shard_size=LIMIT)
    assert os.listdir(ckpt) == ["model.safetensors"]


def test_overwrite_sharded_with_single_file_removes_shards_and_index(tmp_path):
    ckpt = tmp_path / "ckpt"
    ost.save(ckpt, make_tree(TREE_FLOATS, seed=1), max_shard_size=LIMIT)
    (ckpt / "config.json").write_text("{}")
    assert len(os.listdir(ckpt)) == 6
    second = make_tree({"x": 3, "y": 4}, seed=2)
    ost.save(ckpt, second, overwrite=True)
    assert sorted(os.listdir(ckpt)) == ["config.json", "model.safetensors"]
    assert_same_tree(ost.load(ckpt), second)


def test_overwrite_single_file_with_sharded(tmp_path):
    ckpt = tmp_path / "ckpt"
    ost.save(ckpt, make_tree({"x": 3}, seed=1))
    tree = make_tree(TREE_FLOATS, seed=2)
    ost.save(ckpt, tree, max_shard_size=LIMIT, overwrite=True)
    assert sorted(os.listdir(ckpt)) == sorted(shard_names(4) + [INDEX])
    assert_same_tree(ost.load(ckpt), tree)


def test_overwrite_sharded_with_fewer_shards_removes_the_old_ones(tmp_path):
    ckpt = tmp_path / "ckpt"
    ost.save(ckpt, make_tree(TREE_FLOATS, seed=1), max_shard_size=LIMIT)  # 4 files
    tree = make_tree({"p": 10_000, "q": 10_000, "r": 10_000}, seed=2)
    ost.save(ckpt, tree, max_shard_size=81_000, overwrite=True)  # [p, q], [r]
    assert sorted(os.listdir(ckpt)) == sorted(shard_names(2) + [INDEX])
    assert json.loads((ckpt / INDEX).read_text())["weight_map"] == {
        "p": shard_names(2)[0],
        "q": shard_names(2)[0],
        "r": shard_names(2)[1],
    }
    assert_same_tree(ost.load(ckpt), tree)


def test_interrupted_save_is_reported_not_half_loaded(tmp_path):
    """Shards without their index and without one of 1..N: what a copy or a writer that puts
    files down one by one leaves when cut short. (The whole set without index is a checkpoint
    of its own: tests/index/test_unindexed.py.)"""
    ckpt = tmp_path / "ckpt"
    ost.save(ckpt, make_tree(TREE_FLOATS), max_shard_size=LIMIT)
    os.remove(ckpt / INDEX)
    os.remove(ckpt / sorted(n for n in os.listdir(ckpt) if n.startswith("model-"))[-1])
    for api in (ost.load, ost.metadata):
        with pytest.raises(SafetensorsError, match="interrupted"):
            api(ckpt)


def test_a_single_file_save_leaves_its_neighbours_temporaries_alone(tmp_path):
    """Saving ``dir/a.safetensors`` cleans up a crashed earlier save of ``a`` but not the
    in-progress temporary of a concurrent save of ``dir/b.safetensors``."""
    crashed_a = tmp_path / ".a.safetensors.tmp-0123456789ab"
    writing_b = tmp_path / ".b.safetensors.tmp-ba9876543210"
    crashed_a.write_bytes(b"partial")
    writing_b.write_bytes(b"partial")
    ost.save(tmp_path / "a.safetensors", {"w": np.arange(4, dtype=np.float32)})
    assert sorted(os.listdir(tmp_path)) == [writing_b.name, "a.safetensors"]
