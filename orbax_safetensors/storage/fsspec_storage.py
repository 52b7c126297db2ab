"""Any fsspec filesystem (``memory://``, ``gs://``, ``s3://``, ...).

Object stores have no writes at offsets and no rename; this backend maps the
interface onto what fsspec offers (ranged ``cat_file``, streaming ``open``,
``mv``). A checkpoint on such a store is committed by writing its commit
marker last, which the engine does for every backend alike.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import functools
import json
import logging
import posixpath
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, BinaryIO, TypeVar

import fsspec

from orbax_safetensors.errors import CheckpointBusyError
from orbax_safetensors.format.checksums import crc32c
from orbax_safetensors.index import decode_crc, encode_crc
from orbax_safetensors.storage import retry
from orbax_safetensors.storage.base import Capabilities, Replayable, Storage
from orbax_safetensors.storage.executor import Executor

T = TypeVar("T")

_COMPOSE_MAX = 32  # GCS compose sources per call
_S3_MIN_PART = 5 << 20  # S3 multipart parts, all but the last
_S3_SINGLE_PUT = 100 << 20  # s3fs sends less than this as one PUT (which can carry a checksum)
_READ_BLOCK = 16 << 20  # buffered sequential reads
_LOCK_REFRESH = 20.0  # seconds between rewrites of a held lock
_LOCK_STALE = 120.0  # a lock not rewritten for this long belongs to a dead writer
_LOOKUP_THREADS = 4  # host name lookups of an async filesystem at once
_LOG = logging.getLogger("orbax_safetensors")
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
_MERGING_STORES = frozenset({"s3", "s3a", "gs", "gcs"})  # server-side compose / multipart copy


class _LoopExecutor(concurrent.futures.ThreadPoolExecutor):
    """The default executor of an async filesystem's event loop: where aiohttp looks host names
    up (``loop.getaddrinfo``) for s3fs and gcsfs.

    asyncio's own is a ``ThreadPoolExecutor``, which refuses work once the interpreter begins
    to exit: an ``async_save`` still uploading when its script ended failed as soon as a new
    connection needed a lookup (aiohttp keeps them 10 s), and its checkpoint was lost. This
    one runs them on the engine's pool, which takes work while the interpreter exits.
    """

    def __init__(self) -> None:
        super().__init__(max_workers=1)  # starts no thread: every task goes to the pool below
        self._pool = Executor(_LOOKUP_THREADS, name="orbax_safetensors-lookup")

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        return self._pool.submit(functools.partial(fn, *args, **kwargs))

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing to stop: the pool's workers wait for the engine's next tasks."""


_loops_served: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
_loops_lock = threading.Lock()


def _serve_lookups(fs: fsspec.AbstractFileSystem) -> None:
    """Gives ``fs``'s event loop (fsspec's own, shared by its async filesystems) a
    ``_LoopExecutor``, once."""
    loop = getattr(fs, "loop", None) if getattr(fs, "async_impl", False) else None
    if loop is None:
        return
    with _loops_lock:
        if loop not in _loops_served:
            loop.set_default_executor(_LoopExecutor())
            _loops_served.add(loop)


class FsspecStorage(Storage):

    def __init__(self, fs: fsspec.AbstractFileSystem, retries: retry.RetryPolicy = retry.RetryPolicy()):
        _serve_lookups(fs)
        self.fs = fs
        self.retries = retries
        # Sizes of the files, and the directories, seen by the last listing of each directory
        # (``scan``/``listdir``): one LIST answers what would be a HEAD per file. Any change we
        # make forgets them all, by replacing the pair (never clearing it in place): a reader
        # on another thread sees one whole generation, old or new, and a listing that started
        # before a forget fills the generation it started with, which is dropped.
        self._listed: tuple[dict[str, int], set[str]] = ({}, set())
        self._versions: dict[str, tuple] = {}  # what identifies the object each listing saw
        self.capabilities = _capabilities(fs)

    def url(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    def _call(self, path: str, operation: str, fn: Callable[[], T]) -> T:
        return retry.call(self.retries, self.url(path), operation, fn)

    def join(self, directory: str, name: str) -> str:
        return posixpath.join(directory, name)

    def split(self, path: str) -> tuple[str, str]:
        return posixpath.split(path)

    def size(self, path: str) -> int:
        size = self._listed[0].get(path)
        if size is not None:
            return size
        return int(self._call(path, "size", lambda: self.fs.size(path)))

    def modified(self, path: str) -> int | None:
        def ask() -> datetime.datetime | None:
            try:
                return self.fs.modified(path)
            except NotImplementedError:  # the filesystem keeps none (fsspec's default)
                return None
        when = self._call(path, "modification time", ask)
        if when is None:
            return None
        if when.tzinfo is None:  # fsspec's local and memory filesystems give naive UTC
            when = when.replace(tzinfo=datetime.timezone.utc)
        return (when - _EPOCH) // datetime.timedelta(microseconds=1) * 1000

    def scan(self, directory: str) -> None:
        try:
            self.listdir(directory)
        except FileNotFoundError:
            pass

    def _forget_listings(self) -> None:
        self._listed = ({}, set())

    def read(self, path: str, offset: int, length: int) -> bytes:
        return self._call(path, f"read of bytes [{offset}, {offset + length})",
                          lambda: self.fs.cat_file(path, start=offset, end=offset + length))

    def read_scatter(self, path: str, offset: int, buffers: Sequence[memoryview]) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        wanted = sum(len(v) for v in views)
        data = memoryview(self.read(path, offset, wanted))
        if len(data) != wanted:
            raise EOFError(f"{path}: got {len(data)} bytes at offset {offset}, expected {wanted}")
        position = 0
        for view in views:
            view[:] = data[position:position + len(view)]
            position += len(view)

    def write(self, path: str, chunks: Iterable[memoryview | bytes]) -> None:
        """A sequence of chunks (one request) or a ``Replayable`` stream is retried whole;
        a one-shot iterator cannot be replayed, so it gets one attempt here (the client
        still retries its parts)."""
        def upload() -> None:
            try:
                if isinstance(chunks, Sequence):  # one request, no client-side write buffer
                    data = b"".join(chunks)
                    self.fs.pipe_file(path, data, **self._upload_checksum(data))
                    return
                with self.fs.open(path, "wb") as f:
                    for chunk in chunks:
                        f.write(chunk)
            except Exception as e:
                # Not the object (writes create it) nor the request but the upload session:
                # an earlier request of it was done although its answer was lost, and the
                # client's retry of it no longer fits (gone, or another Content-Range
                # expected). Redo it whole.
                if isinstance(e, FileNotFoundError) or "Content-Range" in str(e):
                    raise ConnectionError(f"upload session lost: {e}") from e
                raise
        replayable = isinstance(chunks, (Sequence, Replayable))
        self._forget_listings()
        retry.call(self.retries if replayable else retry.RetryPolicy(attempts=1),
                   self.url(path), "write", upload)

    def _upload_checksum(self, data: bytes) -> dict[str, str]:
        """S3 checks a PUT against the crc32c sent with it and refuses one that differs (a
        corruption on the way); GCS through gcsfs cannot be sent one, and its own crc32c is
        compared instead (``stored_crc32c``)."""
        if _protocols(self.fs) & {"s3", "s3a"} and len(data) < _S3_SINGLE_PUT:
            return {"ChecksumAlgorithm": "CRC32C", "ChecksumCRC32C": encode_crc(crc32c(data))}
        return {}

    def stored_crc32c(self, path: str) -> int | None:
        protocols = _protocols(self.fs)
        if protocols & {"gs", "gcs"}:
            return decode_crc(self._call(path, "info", lambda: self.fs.info(path)).get("crc32c"))
        if protocols & {"s3", "s3a"}:
            bucket, key, _ = self.fs.split_path(path)
            head = self._call(path, "head", lambda: self.fs.call_s3(
                "head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED"))
            if head.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT":  # not a checksum of parts'
                return decode_crc(head.get("ChecksumCRC32C"))
        return None

    def merge(self, destination: str, parts: Sequence[str], sizes: Sequence[int]) -> None:
        """Server-side concatenation where the store has it.

        GCS composes at most 32 sources per call, so many parts are composed
        in a tree. S3 copies parts into a multipart upload, where every part
        but the last must hold at least 5 MiB: runs of smaller parts are
        joined first (through this process, the only bytes that are).
        """
        protocols = _protocols(self.fs)
        if protocols & {"gs", "gcs"}:
            self._compose(destination, list(parts))
        elif protocols & {"s3", "s3a"}:
            sources = self._s3_sources(destination, parts, sizes)
            self._merge_call(destination, sources)
            for joined in set(sources) - set(parts):
                self.remove(joined)
        else:
            super().merge(destination, parts, sizes)

    def _compose(self, destination: str, sources: list[str]) -> None:
        scratch: list[str] = []
        while len(sources) > _COMPOSE_MAX:
            level = []
            for i in range(0, len(sources), _COMPOSE_MAX):
                level.append(f"{destination}.compose-{len(scratch)}")
                self._merge_call(level[-1], sources[i:i + _COMPOSE_MAX])
                scratch.append(level[-1])
            sources = level
        self._merge_call(destination, sources)
        for path in scratch:
            self.remove(path)

    def _merge_call(self, destination: str, sources: list[str]) -> None:
        self._forget_listings()
        self._call(destination, f"server-side merge of {len(sources)} parts",
                   lambda: self.fs.merge(destination, sources))

    def _s3_sources(self, destination: str, parts: Sequence[str], sizes: Sequence[int]) -> list[str]:
        sources: list[str] = []
        group: list[tuple[str, int]] = []
        for i, (part, size) in enumerate(zip(parts, sizes)):
            group.append((part, size))
            if sum(n for _, n in group) >= _S3_MIN_PART or i == len(parts) - 1:
                if len(group) == 1:
                    sources.append(part)
                else:
                    joined = f"{destination}.joined-{len(sources)}"
                    self.write(joined, [self.read(p, 0, n) for p, n in group])
                    sources.append(joined)
                group = []
        return sources

    def open_read(self, path: str) -> BinaryIO:
        return self.fs.open(path, "rb", block_size=_READ_BLOCK)

    def snapshot(self) -> FsspecSnapshot:
        return FsspecSnapshot(self)

    def lock(self, path: str, holder: str) -> Callable[[], None]:
        """An object created only where none exists (S3 ``If-None-Match: *``, GCS
        ``ifGenerationMatch=0``, through fsspec's ``mode="create"``), rewritten every
        ``_LOCK_REFRESH`` seconds while held. One not rewritten for ``_LOCK_STALE`` seconds
        belongs to a dead writer and is replaced. Where a store ignores the condition (some
        emulators) two writers can both believe they hold it: see docs/concepts.md."""
        me = f"{holder}, lock {uuid.uuid4().hex[:12]}"

        def body() -> bytes:
            return json.dumps({"holder": me, "at": time.time()}).encode()

        for _ in range(2):
            try:
                self._call(path, "exclusive create", lambda: self.fs.pipe_file(path, body(), mode="create"))
                break
            except FileExistsError:
                current = self._lock_content(path)
                if current.get("holder") == me:  # our own create, its answer lost and retried
                    break
                if time.time() - float(current.get("at", 0)) < _LOCK_STALE:
                    raise CheckpointBusyError(path, str(current.get("holder", "unknown"))) from None
                _LOG.warning("replacing the lock of a writer silent for %.0f s: %s",
                             time.time() - float(current.get("at", 0)), current.get("holder"))
                self.remove(path)
        else:
            raise CheckpointBusyError(path, "another writer took it as a dead writer's was replaced")
        self._forget_listings()
        stop = threading.Event()

        def refresh() -> None:
            while not stop.wait(_LOCK_REFRESH):
                try:
                    self.fs.pipe_file(path, body())
                except Exception as e:  # the next refresh tries again; the save goes on
                    _LOG.warning("could not refresh the lock %s: %s", path, e)

        thread = threading.Thread(target=refresh, name="orbax_safetensors-lock", daemon=True)
        thread.start()

        def release() -> None:
            stop.set()
            thread.join()
            self.remove(path)
        return release

    def _lock_content(self, path: str) -> dict:
        try:
            raw = self._call(path, "read", lambda: self.fs.cat_file(path))
            content = json.loads(raw)
            return content if isinstance(content, dict) else {}
        except FileNotFoundError:
            return {"at": 0}  # released meanwhile: stale, so the next create may take it
        except ValueError:
            return {}

    def exists(self, path: str) -> bool:
        sizes, dirs = self._listed
        if posixpath.dirname(path) in dirs:
            return path in sizes or path in dirs
        return bool(self._call(path, "exists", lambda: self.fs.exists(path)))

    def isdir(self, path: str) -> bool:
        sizes, dirs = self._listed
        if posixpath.dirname(path) in dirs:  # the last listing of its directory says
            return path in dirs
        return bool(self._call(path, "isdir", lambda: self.fs.isdir(path)))

    def listdir(self, path: str) -> list[str]:
        return list(self.list_versions(path))

    def list_versions(self, path: str) -> dict[str, str]:
        # A listing must not come from a cache filled before another process wrote.
        self.fs.invalidate_cache(path)
        sizes, dirs = self._listed
        listed = self._call(path, "list", lambda: self.fs.ls(path, detail=True))
        versions = {}
        for entry in listed:
            name = entry["name"].rstrip("/")
            if entry.get("type") == "directory":
                dirs.add(name)
                versions[posixpath.basename(name)] = "directory"
            else:
                sizes[name] = int(entry["size"])
                self._versions[name] = _version(entry)
                versions[posixpath.basename(name)] = repr(self._versions[name])
        dirs.add(path)
        return versions

    def makedirs(self, path: str) -> None:
        self._forget_listings()
        self._call(path, "makedirs", lambda: self.fs.makedirs(path, exist_ok=True))

    def rename(self, source: str, destination: str, *, durable: bool = True) -> None:
        self._forget_listings()
        self._call(source, f"rename to {destination}", lambda: self.fs.mv(source, destination))

    def remove(self, path: str) -> None:
        self._call(path, "remove", lambda: self.remove_once(path))

    def remove_tree(self, path: str) -> None:
        self._forget_listings()
        self._call(path, "remove tree", lambda: self.fs.rm(path, recursive=True))

    def rename_tree(self, source: str, destination: str) -> None:
        self._forget_listings()
        self._call(source, f"rename to {destination}",
                   lambda: self.fs.mv(source, destination, recursive=True))

    def remove_once(self, path: str) -> None:
        self._forget_listings()
        try:
            self.fs.rm(path)
        except FileNotFoundError:
            pass  # already gone, maybe by an earlier attempt whose answer was lost


def _protocols(fs: fsspec.AbstractFileSystem) -> set[str]:
    return {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)


def _capabilities(fs: fsspec.AbstractFileSystem) -> Capabilities:
    """Object stores copy on rename and merge server-side; a request to one costs
    milliseconds (a MiB of transfer about as much, so gaps that small are read through),
    and one connection streams tens of MB/s, so a big tensor is cut into more, smaller
    ranged GETs that run in parallel. Other fsspec filesystems (``memory://``) rename
    cheaply and have neither."""
    protocols = _protocols(fs)
    return Capabilities(offset_writes=False, cheap_rename=not protocols & _OBJECT_STORES,
                        server_side_merge=bool(protocols & _MERGING_STORES),
                        pins_versions=False, chunk_bytes=8 << 20, max_gap=1 << 20,
                        first_part_bytes=_S3_MIN_PART if protocols & {"s3", "s3a"} else 0)


def _version(entry: dict) -> tuple:
    """What tells two versions of an object apart in a listing or ``info``: S3's ETag, GCS's
    generation, ``memory://``'s creation time (and the size, everywhere)."""
    return tuple(str(entry.get(k)) for k in ("size", "ETag", "generation", "created", "mtime"))


class FsspecSnapshot(FsspecStorage):
    """Remembers the version of each file it reads (see ``Storage.snapshot``).

    An object store cannot pin a version for later ranged reads, so a reader
    finds out afterwards: ``unchanged`` lists the directories again (one
    request each) and compares versions, and a load that read a changed file
    is read again. Shares the listing caches of the storage it came from, so
    the listing a load starts with also answers its sizes.
    """

    def __init__(self, storage: FsspecStorage):
        super().__init__(storage.fs, storage.retries)
        self._listed, self._versions = storage._listed, storage._versions
        self._seen: dict[str, tuple | None] = {}

    def _remember(self, path: str) -> None:
        if path not in self._seen:
            self._seen[path] = self._versions.get(path) or self._info_version(path)

    def _info_version(self, path: str) -> tuple | None:
        try:
            return _version(self._call(path, "info", lambda: self.fs.info(path)))
        except FileNotFoundError:
            return None

    def size(self, path: str) -> int:
        self._remember(path)
        return super().size(path)

    def read(self, path: str, offset: int, length: int) -> bytes:
        self._remember(path)
        return super().read(path, offset, length)

    def open_read(self, path: str) -> BinaryIO:
        self._remember(path)
        return super().open_read(path)

    def version(self) -> str:
        return repr(sorted(self._seen.items()))

    def unchanged(self, relocate: Callable[[str], str | None] = lambda path: path) -> bool:
        seen = {path: (relocate(path), version) for path, version in self._seen.items()}
        if any(now is None for now, _ in seen.values()):
            return False
        for directory in {posixpath.dirname(now) for now, _ in seen.values()}:
            try:
                self.listdir(directory)
            except FileNotFoundError:
                return False
        return all((self._versions[now] if now in self._versions else self._info_version(now))
                   == version for now, version in seen.values())
