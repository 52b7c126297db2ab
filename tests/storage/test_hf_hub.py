"""``hf://`` paths, offline from a local Hub cache laid out the way huggingface_hub lays it out.

``<cache>/models--org--name/`` holds ``blobs/<hash>`` (the files' bytes, named by their
hash), ``snapshots/<40-hex commit>/...`` (relative symlinks into ``../../blobs``) and
``refs/<revision>`` (the commit a branch, tag or PR ref points at). The cache is built here
in ``tmp_path`` with checkpoints written by ``ost.save``; ``HF_HUB_OFFLINE`` is on and the
Hub endpoint points at a closed port, so nothing here can reach a network. The online path
(``HfFileSystem`` ranged reads) is exercised through a stand-in filesystem that serves the
same cache under the ``hf`` protocol, with the Hub's revision lookup replaced by the refs.
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import fsspec
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_safetensors as ost
from orbax_safetensors.integrations import cli
from orbax_safetensors.storage import Location, hf_hub
from orbax_safetensors.storage.local import LocalStorage

constants = pytest.importorskip("huggingface_hub.constants")

C1, C2, C3 = "1" * 40, "2" * 40, "3" * 40


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty Hub cache, huggingface_hub pointed at it, offline. huggingface_hub reads its
    environment once at import, so its constants are patched as well as the variables."""
    home = tmp_path / "hf-home"
    hub = home / "hub"
    hub.mkdir(parents=True)
    for name, value in {"HF_HOME": home, "HF_HUB_CACHE": hub, "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # were anything to try
    return hub


def _blob_name(data: bytes, name: str) -> str:
    """LFS files are stored under their sha256, other files under their git blob id."""
    if name.endswith(".safetensors"):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def publish(cache: Path, checkpoint: Path, commit: str, *, refs=("main",), repo="org/name",
            kind="models", subfolder="") -> Path:
    """Puts the files of ``checkpoint`` (a directory, or one file) into the cache as commit
    ``commit`` of ``repo``, the way a download does; returns the snapshot directory."""
    repo_dir = cache / f"{kind}--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    files = [checkpoint] if checkpoint.is_file() else sorted(checkpoint.iterdir())
    extras = {"config.json": b'{"model_type": "llama"}', ".gitattributes": b"*.safetensors lfs\n"}
    for relative, data in [(f"{subfolder}/{f.name}".lstrip("/"), f.read_bytes()) for f in files] + \
            list(extras.items()):
        blob = repo_dir / "blobs" / _blob_name(data, relative)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo_dir / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)  # huggingface_hub writes no newline
    return snapshot


def _tree(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"embed.weight": rng.standard_normal((16, 8)).astype(np.float32),
            "layers.0.w": rng.standard_normal((8, 32)).astype(np.float32),
            "layers.0.b": np.arange(32, dtype=np.int32) + seed}


def _saved(tmp_path: Path, seed: int, **save_options) -> tuple[Path, dict]:
    tree = _tree(seed)
    where = tmp_path / f"saved-{seed}-{len(save_options)}"
    ost.save(where, tree, **save_options)
    return where, tree


def _equal(loaded: dict, expected: dict) -> None:
    assert sorted(loaded) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(np.asarray(loaded[name]), value)


# -- offline, from the cache ---------------------------------------------------------------

def test_load_metadata_verify_and_inspect_from_the_cache(tmp_path, cache, capsys):
    saved, tree = _saved(tmp_path, 1)
    snapshot = publish(cache, saved, C1)
    url = "hf://org/name"

    location = Location.resolve(url)
    assert isinstance(location.storage, LocalStorage)  # the fast local path, not HTTP
    assert Path(location.path) == snapshot and location.url == url
    _equal(ost.load(url), tree)
    info = ost.metadata(url)
    assert {n: tuple(s.shape) for n, s in info.tensors.items()} == {
        n: v.shape for n, v in tree.items()}
    assert ost.verify(url).problems == []
    assert cli.main(["inspect", url]) == 0
    assert "layers.0.w" in capsys.readouterr().out
    # and through the snapshot's symlinks, one file named directly
    _equal(ost.load(f"{url}/model.safetensors"), tree)


def test_a_revision_picks_its_snapshot_through_refs(tmp_path, cache):
    saved1, tree1 = _saved(tmp_path, 1)
    saved2, tree2 = _saved(tmp_path, 2)
    saved3, tree3 = _saved(tmp_path, 3)
    publish(cache, saved1, C1, refs=("main",))
    publish(cache, saved2, C2, refs=("v2",))
    publish(cache, saved3, C3, refs=("refs/pr/1",))  # huggingface_hub keeps it at refs/refs/pr/1

    _equal(ost.load("hf://org/name"), tree1)
    _equal(ost.load("hf://org/name@main"), tree1)
    _equal(ost.load("hf://org/name@v2"), tree2)
    _equal(ost.load("hf://org/name", storage_options={"revision": "v2"}), tree2)
    _equal(ost.load(f"hf://org/name@{C2}"), tree2)  # a commit names its own snapshot
    _equal(ost.load("hf://org/name@refs/pr/1"), tree3)
    _equal(ost.load("hf://org/name@refs%2Fpr%2F1"), tree3)
    with pytest.raises(ValueError, match="give one"):
        ost.load("hf://org/name@v2", storage_options={"revision": "main"})
    with pytest.raises(FileNotFoundError, match="'v3'") as missing:
        ost.load("hf://org/name@v3")
    assert "hf://org/name@v3" in str(missing.value)


def test_subfolders_and_datasets(tmp_path, cache):
    saved, tree = _saved(tmp_path, 4)
    publish(cache, saved, C1, subfolder="checkpoints/step-100")
    _equal(ost.load("hf://org/name/checkpoints/step-100"), tree)
    _equal(ost.load("hf://org/name@main/checkpoints/step-100/model.safetensors"), tree)
    publish(cache, saved, C2, repo="org/data", kind="datasets")
    _equal(ost.load("hf://datasets/org/data"), tree)
    with pytest.raises(FileNotFoundError, match="hf://org/name/checkpoints/step-200"):
        ost.load("hf://org/name/checkpoints/step-200")


def test_a_sharded_checkpoint_loads_under_a_sharding(tmp_path, cache):
    saved, tree = _saved(tmp_path, 5, max_shard_size=1200)
    assert len(list(saved.glob("model-*.safetensors"))) > 1
    snapshot = publish(cache, saved, C1)
    assert (snapshot / "model.safetensors.index.json").is_symlink()

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    specs = {"embed.weight": P("x", "y"), "layers.0.w": P(None, "y"), "layers.0.b": P("x")}
    target = {n: jax.ShapeDtypeStruct(v.shape, jnp.dtype(v.dtype), sharding=NamedSharding(mesh, specs[n]))
              for n, v in tree.items()}
    loaded = ost.load("hf://org/name", target)
    for name, value in tree.items():
        assert loaded[name].sharding == target[name].sharding
        np.testing.assert_array_equal(np.asarray(loaded[name]), value)
    assert ost.verify("hf://org/name").problems == []


def test_the_plain_snapshot_path_loads_through_its_symlinks(tmp_path, cache):
    saved, tree = _saved(tmp_path, 6, max_shard_size=1200)
    snapshot = publish(cache, saved, C1)
    assert all(p.is_symlink() for p in snapshot.iterdir())
    _equal(ost.load(snapshot), tree)
    _equal(ost.load(str(snapshot) + "/"), tree)
    assert ost.verify(snapshot).problems == []
    single, single_tree = _saved(tmp_path, 7)
    other = publish(cache, single, C2, refs=())
    _equal(ost.load(other / "model.safetensors"), single_tree)


def test_a_missing_repository_is_named_without_a_deep_traceback(cache, capsys):
    for url in ("hf://org/missing", "hf://org/missing/model.safetensors", "hf://org/missing@v1"):
        with pytest.raises(FileNotFoundError) as raised:
            ost.load(url)
        assert url in str(raised.value) and "local Hugging Face cache" in str(raised.value)
        assert raised.value.errno == errno.ENOENT
        assert raised.value.__cause__ is None and raised.value.__suppress_context__
        with pytest.raises(FileNotFoundError, match=url):
            ost.metadata(url)
    assert cli.main(["inspect", "hf://org/missing"]) == 1
    err = capsys.readouterr().err
    assert "hf://org/missing" in err and len(err.strip().splitlines()) == 1


def test_saving_to_hf_is_refused_before_anything_is_written(tmp_path, cache):
    saved, tree = _saved(tmp_path, 8)
    snapshot = publish(cache, saved, C1)
    before = sorted((p.relative_to(cache), p.is_symlink()) for p in cache.rglob("*"))
    for url in ("hf://org/name", "hf://org/name/model.safetensors", "hf://org/name/new"):
        with pytest.raises(OSError, match="read-only") as refused:
            ost.save(url, _tree(9), overwrite=True)
        assert refused.value.errno == errno.EROFS and refused.value.filename == url
    assert sorted((p.relative_to(cache), p.is_symlink()) for p in cache.rglob("*")) == before
    _equal(ost.load(snapshot), tree)


def test_local_files_only_and_cache_dir_work_without_offline_mode(tmp_path, cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    saved, tree = _saved(tmp_path, 10)
    publish(elsewhere, saved, C1)

    def no_network(*args, **kwargs):
        raise AssertionError("local_files_only asked the Hub")
    monkeypatch.setattr(hf_hub, "remote_commit", no_network)
    _equal(ost.load("hf://org/name", storage_options={
        "local_files_only": True, "cache_dir": str(elsewhere)}), tree)


def test_offline_mode_set_after_huggingface_hub_was_imported(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # read at import, before the env
    assert hf_hub.offline()  # HF_HUB_OFFLINE=1 in the environment now
    saved, tree = _saved(tmp_path, 11)
    publish(cache, saved, C1)
    _equal(ost.load("hf://org/name"), tree)


# -- the local backend and symlinks ----------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_symlink_to_a_non_regular_file_is_refused_by_name(tmp_path, cache, kind):
    saved, _ = _saved(tmp_path, 12, max_shard_size=1200)
    snapshot = publish(cache, saved, C1)
    victim = max(snapshot.glob("model-*.safetensors"))
    blob = victim.resolve()
    blob.unlink()
    if kind == "fifo":
        os.mkfifo(blob)
    else:
        blob.mkdir()
    assert victim.is_symlink()
    for load in (lambda: ost.load("hf://org/name"), lambda: ost.load(snapshot)):
        with pytest.raises(ost.SafetensorsError, match=f"(?i){victim.name}.*is a {kind}"):
            load()
    problems = " ".join(str(p) for p in ost.verify(snapshot).problems)
    assert victim.name in problems and f"a {kind}" in problems.lower()


def test_a_symlinks_version_is_its_targets(tmp_path):
    target = tmp_path / "blob"
    target.write_bytes(b"one")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "file").symlink_to("../blob")
    (tmp_path / "dir" / "dangling").symlink_to("../nothing")
    storage = LocalStorage()
    first = storage.list_versions(str(tmp_path / "dir"))
    assert first["file"] == f"{target.stat().st_dev}:{target.stat().st_ino}"
    replacement = tmp_path / "blob.new"
    replacement.write_bytes(b"two")
    os.replace(replacement, target)  # the link is untouched; what it reads is another file
    assert storage.list_versions(str(tmp_path / "dir"))["file"] != first["file"]
    assert first["dangling"].startswith("dangling")


# -- the online path, through a stand-in for HfFileSystem -------------------------------------

class FakeHub(fsspec.AbstractFileSystem):
    """Serves ``ORG/NAME@<commit>/...`` from the snapshots of a local cache, as HfFileSystem
    serves them from the Hub; remembers the keyword arguments of every ranged read."""

    protocol = "hf"
    cachable = False
    endpoint, token = "http://127.0.0.1:9", None

    def __init__(self, cache: Path):
        super().__init__()
        self.cache, self.read_options = cache, []

    def _local(self, path: str) -> Path:
        path = self._strip_protocol(path)
        namespace, rest = path.split("/", 1)
        name_at, _, inner = rest.partition("/")
        name, _, commit = name_at.partition("@")
        assert len(commit) == 40, f"not pinned to a commit: {path}"
        return self.cache / f"models--{namespace}--{name}" / "snapshots" / commit / inner

    def ls(self, path, detail=True, **kwargs):
        local = self._local(path)
        if not local.is_dir():
            raise FileNotFoundError(path)
        entries = [self.info(f"{path.rstrip('/')}/{p.name}") for p in sorted(local.iterdir())]
        return entries if detail else [e["name"] for e in entries]

    def info(self, path, **kwargs):
        local = self._local(path)
        if not local.exists():
            raise FileNotFoundError(path)
        return {"name": self._strip_protocol(path).rstrip("/"), "size": local.stat().st_size,
                "type": "directory" if local.is_dir() else "file", "blob_id": local.resolve().name}

    def cat_file(self, path, start=None, end=None, **kwargs):
        self.read_options.append(kwargs)
        with open(self._local(path), "rb") as f:
            f.seek(start or 0)
            return f.read(None if end is None else end - (start or 0))

    def _open(self, path, mode="rb", **kwargs):
        return open(self._local(path), mode)


@pytest.fixture
def online(cache, monkeypatch):
    """Online mode, the revision looked up in the cache's refs instead of asking the Hub."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    asked = []

    def commit_from_refs(fs, hub):
        asked.append(hub)
        ref = cache / f"models--{hub.repo_id.replace('/', '--')}" / "refs" / (hub.revision or "main")
        return hub.revision if len(hub.revision or "") == 40 else ref.read_text()
    monkeypatch.setattr(hf_hub, "remote_commit", commit_from_refs)
    return asked


def test_online_reads_go_through_the_filesystem_pinned_to_one_commit(tmp_path, cache, online):
    saved, tree = _saved(tmp_path, 13, max_shard_size=1200)
    publish(cache, saved, C1)
    saved2, tree2 = _saved(tmp_path, 14)
    publish(cache, saved2, C2, refs=("v2",), subfolder="sub")
    hub = FakeHub(cache)

    location = Location.resolve("hf://org/name", filesystem=hub)
    assert isinstance(location.storage, hf_hub.HubStorage)
    assert location.path == f"org/name@{C1}" and location.storage.version() == C1
    capabilities = location.storage.capabilities
    assert capabilities.pins_versions and not capabilities.offset_writes
    assert location.storage.snapshot() is location.storage  # a commit never changes
    _equal(ost.load("hf://org/name", filesystem=hub), tree)
    assert hub.read_options and all(o == {"cache_type": "none"} for o in hub.read_options)
    _equal(ost.load("hf://org/name@v2/sub", filesystem=hub), tree2)
    _equal(ost.load("hf://org/name@v2/sub/model.safetensors", filesystem=hub), tree2)
    assert ost.verify("hf://org/name", filesystem=hub).problems == []
    with pytest.raises(OSError, match="read-only") as refused:
        ost.save("hf://org/name", _tree(1), filesystem=hub, overwrite=True)
    assert refused.value.errno == errno.EROFS and refused.value.filename == "hf://org/name"


def test_an_unreachable_hub_falls_back_to_the_cache(tmp_path, cache, online, monkeypatch, caplog):
    saved, tree = _saved(tmp_path, 15)
    publish(cache, saved, C1)

    def unreachable(fs, hub):
        raise ConnectionError("no route to host")
    monkeypatch.setattr(hf_hub, "remote_commit", unreachable)
    hub = FakeHub(cache)
    assert isinstance(Location.resolve("hf://org/name", filesystem=hub).storage, LocalStorage)
    _equal(ost.load("hf://org/name", filesystem=hub), tree)
    assert "did not answer" in caplog.text
    with pytest.raises(ConnectionError, match="hf://org/other.*did not answer"):
        ost.load("hf://org/other", filesystem=hub)


@pytest.mark.parametrize("error, raised, words", [
    ("RepositoryNotFoundError", FileNotFoundError, "no repository org/other, or it is private"),
    ("GatedRepoError", PermissionError, "gated repository"),
    ("RevisionNotFoundError", FileNotFoundError, "no revision"),
])
def test_the_hubs_refusals_are_named(cache, online, monkeypatch, error, raised, words):
    from types import SimpleNamespace

    from huggingface_hub import errors

    def refuse(fs, hub):
        raise getattr(errors, error)("404", response=SimpleNamespace(headers={}, request=None))
    monkeypatch.setattr(hf_hub, "remote_commit", refuse)
    with pytest.raises(raised, match=words) as refused:
        ost.load("hf://org/other", filesystem=FakeHub(cache))
    assert refused.value.filename == "hf://org/other"


def test_a_ranged_read_through_hffilesystem_fetches_exactly_the_range(monkeypatch):
    """HfFileSystem itself (no network: its repository check, listing and HTTP GET are
    replaced): a read is one GET of exactly the bytes asked for, not fsspec's read-ahead."""
    from huggingface_hub import HfFileSystem
    from huggingface_hub.hf_file_system import HfFileSystemFile

    data = bytes(range(256)) * 64
    name = f"org/name@{C1}/model.safetensors"
    monkeypatch.setattr(HfFileSystem, "_repo_and_revision_exist", lambda self, *args: (True, None))
    monkeypatch.setattr(HfFileSystem, "info", lambda self, path, **kwargs: {
        "name": name, "size": len(data), "type": "file"})
    fetched = []

    def fetch(self, start, end):
        fetched.append((start, end))
        return data[start:end]
    monkeypatch.setattr(HfFileSystemFile, "_fetch_range", fetch)
    storage = hf_hub.HubStorage(HfFileSystem(skip_instance_cache=True), C1, "hf://org/name")
    assert storage.read(name, 100, 1000) == data[100:1100]
    assert fetched == [(100, 1100)]
    buffers = [memoryview(bytearray(10)), memoryview(bytearray(20))]
    storage.read_scatter(name, 5, buffers)
    assert bytes(buffers[0]) + bytes(buffers[1]) == data[5:35]


# -- the URL grammar ------------------------------------------------------------------------

@pytest.mark.parametrize("url, parsed", [
    ("hf://org/name", ("model", "org/name", None, "")),
    ("hf://org/name/", ("model", "org/name", None, "")),
    ("hf://org/name@v1.0", ("model", "org/name", "v1.0", "")),
    ("hf://org/name@v1.0/sub/dir", ("model", "org/name", "v1.0", "sub/dir")),
    ("hf://org/name/sub/model.safetensors", ("model", "org/name", None, "sub/model.safetensors")),
    ("hf://org/name@refs/pr/1", ("model", "org/name", "refs/pr/1", "")),
    ("hf://org/name@refs/pr/1/sub", ("model", "org/name", "refs/pr/1", "sub")),
    ("hf://org/name@refs%2Fpr%2F1/sub", ("model", "org/name", "refs/pr/1", "sub")),
    ("hf://org/name@refs/convert/parquet", ("model", "org/name", "refs/convert/parquet", "")),
    ("hf://org/name@feature%2Fx/sub", ("model", "org/name", "feature/x", "sub")),
    (f"hf://org/name@{C1}", ("model", "org/name", C1, "")),
    ("hf://datasets/org/data@main/x", ("dataset", "org/data", "main", "x")),
    ("hf://spaces/org/app", ("space", "org/app", None, "")),
    ("hf://models/org/name", ("model", "org/name", None, "")),
])
def test_urls_are_taken_apart_like_hffilesystem_does(url, parsed):
    assert tuple(hf_hub.parse(url)) == parsed


@pytest.mark.parametrize("url", ["hf://name", "hf://org/name@", "hf://org/name/../other",
                                 "hf://org/name/a//b", "hf://buckets/org/b", "hf://org@x/name"])
def test_bad_urls_are_refused_by_name(url):
    with pytest.raises(ValueError, match="hf://"):
        hf_hub.parse(url)
