"""``hf://`` paths: checkpoints of a Hugging Face Hub repository, read in place or from the
local Hub cache.

``hf://[datasets/|spaces/]ORG/NAME[@REVISION][/PATH]`` is the grammar of huggingface_hub's
``HfFileSystem``: a model repository unless prefixed, the revision a branch, tag or commit
(default ``main``; one holding ``/`` is quoted, ``@feature%2Fx``, except ``refs/pr/N`` and
``refs/convert/NAME``, which may be written as they are), and PATH a subfolder holding a
checkpoint or, ending in ``.safetensors``, one file. ``storage_options`` are
``HfFileSystem``'s (``token``, ``endpoint``, ...) plus three of ours: ``revision`` (instead of
``@REVISION``), ``local_files_only`` and ``cache_dir`` (default ``HF_HUB_CACHE``).

Resolved once, where a public function receives the path (``Location.resolve``), to one
commit, which never changes, so every read of a load sees the same files:

* **Offline** (``HF_HUB_OFFLINE=1``, or ``local_files_only=True``): huggingface_hub's own
  ``snapshot_download(local_files_only=True)`` finds the revision's commit in the local
  cache (``refs/<revision>``; a commit hash names itself) and its snapshot directory,
  ``<cache>/models--ORG--NAME/snapshots/<commit>/``, is read with the local backend
  (``preadv`` into the caller's buffers, each file pinned by its descriptor). Its files
  are symlinks into ``../../blobs/``, which that backend follows. Nothing is downloaded.
* **Online**: one Hub request resolves the revision to its commit, and the files of
  ``ORG/NAME@<commit>`` are read through ``HfFileSystem`` with ranged GETs, without a
  download. When the Hub does not answer (no network, an outage, a private repository and
  no token), the local cache's copy of the revision is read instead where there is one,
  as huggingface_hub does itself; a revision the Hub says does not exist is an error.

Either way the location is read-only: the first write of a save, consolidate or convert
into it fails with ``EROFS`` naming the URL. Nothing here writes to the Hub (a commit per
file, no atomic swap of several) or into the cache, whose snapshots are symlinks into
content-addressed blobs that other commits share.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import fsspec

from orbax_safetensors.errors import (
    AccessDeniedError,
    ArgumentError,
    MissingDependencyError,
    MissingFileError,
    ReadOnlyLocationError,
    UnreachableError,
)
from orbax_safetensors.storage import retry
from orbax_safetensors.storage.base import Capabilities, Storage
from orbax_safetensors.storage.fsspec_storage import FsspecStorage
from orbax_safetensors.storage.local import LocalSnapshot, LocalStorage

PROTOCOL = "hf://"
_LOG = logging.getLogger("orbax_safetensors")

_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
_PREFIXES = {"model": "", "dataset": "datasets/", "space": "spaces/"}
_UNSUPPORTED = {"buckets": "Hub buckets are not versioned", "kernels": "kernel repositories"}
# Revisions that hold '/' and may be written unquoted (HfFileSystem's rule).
_SPECIAL_REF = re.compile(r"refs/(?:convert/[\w.-]+|pr/\d+)(?=/|$)")
_TRUE = {"1", "ON", "YES", "TRUE"}
_GRAMMAR = "hf://[datasets/|spaces/]ORG/NAME[@REVISION][/PATH]"
_OPTIONS = ("revision", "local_files_only", "cache_dir")  # ours; the rest are HfFileSystem's

# A ranged GET of the Hub is a request to huggingface.co answered by a redirect to its CDN:
# two round trips, and resolve requests count against the Hub's rate limits, so reads are
# fewer and bigger than on a bucket (a load's memory budget, 1 GB by default, still holds
# many of them in flight).
_HUB_CHUNK = 32 << 20
_HUB_GAP = 4 << 20


class HubPath(NamedTuple):
    """An ``hf://`` URL taken apart. ``revision`` is ``None`` where the URL names none."""

    repo_type: str  # "model", "dataset" or "space"
    repo_id: str  # "ORG/NAME"
    revision: str | None
    path_in_repo: str  # "" for the repository's root


def is_hub_url(url: str) -> bool:
    return url.startswith(PROTOCOL)


def is_hub_filesystem(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = getattr(fs, "protocol", ())
    return "hf" in ({protocol} if isinstance(protocol, str) else set(protocol))


def parse(url: str) -> HubPath:
    """The parts of ``url`` (``ValueError`` naming it when it does not follow the grammar)."""
    from urllib.parse import unquote

    def bad(why: str) -> ValueError:
        return ValueError(f"{url!r}: {why} (expected {_GRAMMAR})")

    if not is_hub_url(url):
        raise bad(f"not an {PROTOCOL} URL")
    segments = url[len(PROTOCOL):].strip("/").split("/")
    repo_type = "model"
    if segments[0] in _UNSUPPORTED:
        raise bad(f"{PROTOCOL}{segments[0]}/ is not supported ({_UNSUPPORTED[segments[0]]})")
    if segments[0] in _TYPES:
        repo_type = _TYPES[segments.pop(0)]
    if len(segments) < 2 or not segments[0] or not segments[1] or "@" in segments[0]:
        raise bad("a repository is named ORG/NAME")
    namespace, name = segments[0], segments[1]
    revision, path = None, "/".join(segments[2:])
    if "@" in name:
        name, _, after = name.partition("@")
        after = "/".join([after, *segments[2:]])
        special = _SPECIAL_REF.match(after)
        if special:
            revision, path = special.group(0), after[special.end():].lstrip("/")
        else:
            quoted, _, path = after.partition("/")
            revision = unquote(quoted)
        if not revision or not name:
            raise bad("empty revision" if name else "a repository is named ORG/NAME")
    parts = path.split("/") if path else []
    if any(part in ("", ".", "..") for part in parts):
        raise bad(f"the path in the repository, {path!r}, has an empty, '.' or '..' part")
    return HubPath(repo_type, f"{namespace}/{name}", revision, path)


def resolve(url: str, storage_options: Mapping[str, Any] | None = None,
            filesystem: fsspec.AbstractFileSystem | None = None) -> tuple[Storage, str]:
    """The read-only storage for the ``hf://`` ``url`` and the path in its form (see the
    module docstring). ``filesystem``: an ``HfFileSystem`` to read through online."""
    hub_module = _huggingface_hub(url)
    constants = hub_module.constants
    hub = parse(url if is_hub_url(url) else PROTOCOL + url.lstrip("/"))
    options = dict(storage_options or {})
    revision = options.pop("revision", None)
    local_only = _true(options.pop("local_files_only", False))
    cache_dir = options.pop("cache_dir", None)
    if revision is not None:
        if hub.revision is not None and hub.revision != str(revision):
            raise ArgumentError(f"{url!r} names revision {hub.revision!r}, storage_options "
                             f"revision {revision!r}: give one")
        hub = hub._replace(revision=str(revision))
    try:
        hub_module.utils.validate_repo_id(hub.repo_id)
    except ValueError as e:
        raise ArgumentError(f"{url!r}: {e}") from None
    cache_dir = os.fspath(cache_dir) if cache_dir is not None else constants.HF_HUB_CACHE
    if local_only or offline():
        return _from_cache(url, hub, cache_dir, hub_module)
    fs = filesystem if filesystem is not None else hub_module.HfFileSystem(**options)
    try:
        commit = remote_commit(fs, hub)
    except hub_module.errors.RevisionNotFoundError:
        raise MissingFileError(f"the Hugging Face Hub has no revision {hub.revision!r} of "
                               f"{hub.repo_id}", file=url) from None
    except Exception as e:  # noqa: BLE001 -- unanswered or refused: the cache may hold it, as
        # huggingface_hub's snapshot_download has it; where it does not, ``e`` is raised, named
        try:
            found = _from_cache(url, hub, cache_dir, hub_module)
        except FileNotFoundError:
            raise _unavailable(url, hub, cache_dir, e, hub_module) from e
        _LOG.warning("%s: the Hugging Face Hub did not answer (%s: %s); reading the copy in "
                     "the local cache", url, type(e).__name__, e)
        return found
    path = f"{_PREFIXES[hub.repo_type]}{hub.repo_id}@{commit}"
    return HubStorage(fs, commit, url), f"{path}/{hub.path_in_repo}" if hub.path_in_repo else path


def remote_commit(fs: fsspec.AbstractFileSystem, hub: HubPath) -> str:
    """The commit ``hub.revision`` names now, asked of the Hub ``fs`` talks to."""
    from huggingface_hub import HfApi
    info = HfApi(endpoint=fs.endpoint, token=fs.token).repo_info(
        hub.repo_id, repo_type=hub.repo_type, revision=hub.revision)
    if not info.sha:
        raise UnreachableError(f"the Hub gave no commit for {hub.repo_id}@{hub.revision or 'main'}")
    return info.sha


def offline() -> bool:
    """huggingface_hub's offline mode, or ``HF_HUB_OFFLINE`` set after it was imported (it
    reads the variable once, at import)."""
    from huggingface_hub import constants
    return bool(getattr(constants, "HF_HUB_OFFLINE", False)) or any(
        _true(os.environ.get(name)) for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _true(value: Any) -> bool:
    return value is True or str(value).upper() in _TRUE


def _huggingface_hub(url: str):
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
        import huggingface_hub.utils
    except ImportError:
        raise MissingDependencyError(f"{url!r}: hf:// paths need huggingface_hub: "
                                     "pip install 'orbax_safetensors[hf]'") from None
    return huggingface_hub


def _from_cache(url: str, hub: HubPath, cache_dir: str, hub_module) -> tuple[Storage, str]:
    """The revision's snapshot directory in the local cache, read with the local backend."""
    revision = hub.revision or hub_module.constants.DEFAULT_REVISION
    try:
        # No file is required (allow_patterns=[]): the catalog says what the checkpoint
        # needs and names a missing file; a snapshot downloaded with patterns (only the
        # safetensors files, say) lacks others of the repository's and still loads.
        snapshot = hub_module.snapshot_download(
            hub.repo_id, repo_type=hub.repo_type, revision=revision, cache_dir=cache_dir,
            local_files_only=True, allow_patterns=[])
    except FileNotFoundError:
        raise MissingFileError(
            f"revision {revision!r} of {hub.repo_id} is not in the local Hugging Face cache "
            f"{cache_dir} (offline: nothing is downloaded; `hf download {hub.repo_id}` fetches "
            "it)", file=url) from None
    snapshot = os.fspath(snapshot)
    parts = hub.path_in_repo.split("/") if hub.path_in_repo else []
    return CachedStorage(os.path.basename(snapshot.rstrip(os.sep)), snapshot, url), \
        os.path.join(snapshot, *parts)


def _unavailable(url: str, hub: HubPath, cache_dir: str, error: Exception, hub_module) -> OSError:
    """What to raise when the Hub did not give the commit and the cache has no copy."""
    errors = hub_module.errors
    hint = "pass storage_options={'token': ...} (or log in with `hf auth login`)"
    if isinstance(error, errors.GatedRepoError):
        return AccessDeniedError(errno.EACCES, f"{hub.repo_id} is a gated repository: accept its "
                                 f"terms on the Hub and {hint}", url)
    if isinstance(error, errors.RepositoryNotFoundError):
        return MissingFileError(f"the Hugging Face Hub has no repository {hub.repo_id}, or it "
                                f"is private: {hint}", file=url)
    return UnreachableError(f"{url}: the Hugging Face Hub did not answer ({type(error).__name__}: "
                           f"{error}) and the local cache {cache_dir} does not hold this revision")


class _ReadOnly:
    """Refuses every write, naming the ``hf://`` URL, before anything is written."""

    hub_url: str

    def _refuse(self, *args: Any, **kwargs: Any):
        raise ReadOnlyLocationError(
            "hf:// locations are read-only: orbax_safetensors does not write to the Hugging "
            "Face Hub or into its local cache (save to a local path or a bucket, then upload it "
            "with huggingface_hub's upload_folder)", self.hub_url)

    write = create_sized = write_at = merge = sync = makedirs = rename = _refuse
    sync_directory = remove = remove_tree = rename_tree = lock = remove_once = _refuse

    def discard(self, paths) -> None:
        """Nothing was written, so nothing is left to remove."""


class HubStorage(_ReadOnly, FsspecStorage):
    """One commit of a Hub repository through ``HfFileSystem``: ranged GETs of files that
    never change, so its reads are a snapshot by themselves."""

    def __init__(self, fs: fsspec.AbstractFileSystem, commit: str, hub_url: str,
                 retries: retry.RetryPolicy = retry.RetryPolicy()):
        super().__init__(fs, retries)
        self.commit, self.hub_url = commit, hub_url
        self.capabilities = Capabilities(offset_writes=False, cheap_rename=False,
                                         pins_versions=True, chunk_bytes=_HUB_CHUNK,
                                         max_gap=_HUB_GAP)

    def read(self, path: str, offset: int, length: int) -> bytes:
        # cache_type="none": exactly the bytes asked for, in one GET (fsspec's default
        # read-ahead would fetch another 5 MB after every range).
        return self._call(path, f"read of bytes [{offset}, {offset + length})",
                          lambda: self.fs.cat_file(path, start=offset, end=offset + length,
                                                   cache_type="none"))

    def list_versions(self, path: str) -> dict[str, str]:
        """A commit's listing never changes: HfFileSystem's cached one is as good as new
        (and answers the sizes and existence checks that follow without a request)."""
        entries = self._call(path, "list", lambda: self.fs.ls(path, detail=True))
        return {posixpath.basename(e["name"].rstrip("/")):
                "directory" if e.get("type") == "directory" else str(e.get("blob_id") or e.get("size"))
                for e in entries}

    def snapshot(self) -> HubStorage:  # type: ignore[override]  # pinned by the commit already
        return self

    def version(self) -> str:
        return self.commit


class CachedStorage(_ReadOnly, LocalStorage):
    """One commit's snapshot directory in the local Hub cache, read with the local backend."""

    def __init__(self, commit: str, root: str, hub_url: str):
        super().__init__()
        self.commit, self.root, self.hub_url = commit, root, hub_url

    def snapshot(self) -> LocalSnapshot:
        return _CommitSnapshot(self.commit, self.root)


class _CommitSnapshot(LocalSnapshot):
    """Pins each file by descriptor like any local read; its version is the commit and the
    files' names in it, so processes on hosts with caches of their own (other paths, other
    inodes) agree exactly when they read the same commit."""

    def __init__(self, commit: str, root: str):
        super().__init__()
        self.commit, self.root = commit, root

    def version(self) -> str:
        with self._guard:
            names = sorted(os.path.relpath(path, self.root) for path in self._open)
        return repr((self.commit, names))
