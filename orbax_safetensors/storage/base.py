"""The byte I/O interface every backend implements.

Everything above this layer speaks in (path, offset, length) and caller-owned
buffers, so the engine never knows whether bytes come from a local disk, a
bucket or memory, and a backend can pick the fastest way to fill a buffer
(``preadv`` straight into it locally; ranged GETs on object stores).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import BinaryIO

from orbax_safetensors.storage.executor import Executor

_LOG = logging.getLogger("orbax_safetensors")
_DISCARD_THREADS = 8


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared once: the engine picks its write strategy and the
    commit picks its protocol from these, never from the backend's type.

    Attributes:
      offset_writes: several processes may fill one file at offsets (``create_sized``,
        ``write_at``): local disks and NFS.
      cheap_rename: ``rename`` is a metadata operation, not a copy of the bytes (object
        stores copy), so files can be staged under temporary names and swapped in.
      server_side_merge: ``merge`` concatenates parts without moving their bytes through
        this process (GCS compose, S3 multipart copy).
      pins_versions: a ``snapshot``'s reads of a file all see the version its first read
        saw (locally: one open descriptor); elsewhere a reader checks ``unchanged``.
      chunk_bytes: the largest single read worth making; bigger runs become parallel reads.
      max_gap: bytes between two needed runs worth reading through rather than
        splitting the read (what one more request costs, in bytes).
      first_part_bytes: the least a ``merge``'s first part must hold to be merged without
        passing the bytes after it through this process (S3: 5 MiB).
    """

    offset_writes: bool = False
    cheap_rename: bool = True
    server_side_merge: bool = False
    pins_versions: bool = False
    chunk_bytes: int = 32 << 20
    max_gap: int = 0
    first_part_bytes: int = 0


class Replayable(Iterable):
    """A stream of chunks that can be produced again from its start (``produce`` makes a
    fresh iterator each time). A write given one is retried whole on a transient failure;
    a one-shot iterator cannot be replayed, so it gets one attempt."""

    def __init__(self, produce: Callable[[], Iterable[memoryview | bytes]]):
        self._produce = produce

    def __iter__(self) -> Iterator[memoryview | bytes]:
        return iter(self._produce())

    def after(self, skip: int, resume: Iterator[memoryview | bytes] | None = None) -> Replayable:
        """The same stream without its first ``skip`` bytes; its first pass is ``resume``
        where given (an iterator of this stream already ``skip`` bytes in), so nothing is
        produced twice unless the stream is replayed."""
        first = [resume] if resume is not None else []

        def rest() -> Iterator[memoryview | bytes]:
            if first:
                yield from first.pop()
                return
            left = skip
            for chunk in self:
                view = memoryview(chunk).cast("B")
                if left < len(view):
                    yield view[left:]
                left = max(0, left - len(view))
        return Replayable(rest)


class Storage(abc.ABC):
    """Byte-level access to one filesystem. Paths are in the backend's own form."""

    capabilities: Capabilities = Capabilities()

    @abc.abstractmethod
    def join(self, directory: str, name: str) -> str:
        """The path of ``name`` inside ``directory``."""

    @abc.abstractmethod
    def split(self, path: str) -> tuple[str, str]:
        """``(directory, name)`` of a file path."""

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Length of the file in bytes; FileNotFoundError if absent."""

    @abc.abstractmethod
    def read(self, path: str, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes from ``offset`` (fewer only at end of file)."""

    @abc.abstractmethod
    def read_scatter(self, path: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fills ``buffers`` back to back from the file range starting at ``offset``.

        One ranged read, scattered: the caller passes views of its destination
        arrays (and of a scratch buffer for bytes it does not need), so data
        lands where it belongs without an intermediate copy where the backend
        allows. Raises EOFError if the file ends first.
        """

    @abc.abstractmethod
    def write(self, path: str, chunks: Iterable[memoryview | bytes]) -> None:
        """Writes a whole new file from ``chunks``, streaming, durable on return."""

    def create_sized(self, path: str, size: int, head: bytes) -> None:
        """Creates ``path`` with ``head`` at offset 0 and its final ``size``."""
        raise NotImplementedError(f"{type(self).__name__} cannot write at offsets")

    def write_at(self, path: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """Writes ``buffers`` back to back at ``offset`` of an existing file."""
        raise NotImplementedError(f"{type(self).__name__} cannot write at offsets")

    def merge(self, destination: str, parts: Sequence[str], sizes: Sequence[int]) -> None:
        """Writes ``destination`` as the concatenation of ``parts`` (of ``sizes`` bytes).

        This default streams every part through this process; backends with
        server-side concatenation override it.
        """
        self.write(destination, Replayable(lambda: (self.read(p, 0, n) for p, n in zip(parts, sizes))))

    def stored_crc32c(self, path: str) -> int | None:
        """The crc32c the store itself keeps of the whole object (GCS for every object, S3
        where one was sent with it), or ``None``: a check of our bytes against theirs that
        costs a metadata request, not a read."""
        return None

    def modified(self, path: str) -> int | None:
        """When the file was last written, in nanoseconds since the epoch; ``None`` where the
        store keeps no such time."""
        return None

    def sync(self, path: str) -> None:
        """Makes every write to ``path`` so far durable."""
        raise NotImplementedError(f"{type(self).__name__} cannot write at offsets")

    @abc.abstractmethod
    def open_read(self, path: str) -> BinaryIO:
        """A buffered reader, for reading an object front to back in large requests."""

    def special_kind(self, path: str) -> str | None:
        """What ``path`` is when it is neither a regular file nor a directory ("a FIFO", "a
        symbolic link to 'x', which does not exist"), for messages; ``None`` otherwise, and
        where there are no such things (object stores)."""
        return None

    @abc.abstractmethod
    def exists(self, path: str) -> bool: ...

    @abc.abstractmethod
    def isdir(self, path: str) -> bool: ...

    @abc.abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Names (not paths) of the entries of a directory."""

    def list_versions(self, path: str) -> dict[str, str]:
        """The entries of a directory, each with what identifies its current version (locally
        the inode, on object stores the ETag or generation): a name whose file was replaced,
        however many times, shows another version. This default knows names only."""
        return dict.fromkeys(self.listdir(path), "")

    @abc.abstractmethod
    def makedirs(self, path: str) -> None: ...

    def make_directories(self, path: str) -> list[str]:
        """``makedirs``, returning the directories it made, deepest first, where a directory
        outlives what is in it (a local disk), so that a writer that fails can remove them
        again (``remove_empty_directory``); none elsewhere (an object store's "directory" is
        only the objects in it, and goes with them)."""
        self.makedirs(path)
        return []

    def remove_empty_directory(self, path: str) -> bool:
        """Removes ``path`` if it is an empty directory; whether it did."""
        return False

    @abc.abstractmethod
    def rename(self, source: str, destination: str, *, durable: bool = True) -> None:
        """Moves a file, replacing ``destination``; atomic where the backend allows.

        ``durable=False`` leaves making the new name survive a power cut to a
        later ``sync_directory`` (one flush for many renames).
        """

    def sync_directory(self, directory: str) -> None:
        """Makes every rename and removal in ``directory`` so far survive a power cut."""

    @abc.abstractmethod
    def remove(self, path: str) -> None:
        """Deletes a file; a missing file is not an error."""

    @abc.abstractmethod
    def remove_tree(self, path: str) -> None:
        """Deletes a directory and everything in it (only ever one we wrote)."""

    @abc.abstractmethod
    def rename_tree(self, source: str, destination: str) -> None:
        """Moves a directory to a name that does not exist (a copy on object stores)."""

    def url(self, path: str) -> str:
        """``path`` as a URL other libraries (Orbax, TensorStore) open: itself, locally."""
        return path

    def snapshot(self) -> Storage:
        """A view of this storage whose reads of each file all see one version of it.

        Locally a file is opened once, at its first read, and every later read
        goes to that open file, so a rename over its name (an overwrite
        committing) does not switch files under a reader; ``unchanged`` then
        tells whether every name still points at the file that was read.
        Backends that cannot pin a version return themselves.
        """
        return self

    def unchanged(self, relocate: Callable[[str], str | None] = lambda path: path) -> bool:
        """On a snapshot: whether every file read through it is still there, at the path
        ``relocate`` gives for the path it was read at (a commit in progress moves the old
        checkpoint's files to backup names without changing them)."""
        return True

    def version(self) -> str:
        """On a snapshot: what identifies the versions of the files read so far (equal on two
        processes exactly when they read the same files)."""
        return ""

    def close(self) -> None:
        """Releases what a snapshot holds open; a plain storage holds nothing."""

    def lock(self, path: str, holder: str) -> Callable[[], None]:
        """Takes the writer lock ``path`` (a file next to the checkpoint) for ``holder``.

        Returns the release function. Raises ``CheckpointBusyError`` naming the
        current holder when another live writer has it; a dead holder's lock is
        free again. This default, for a backend with no way to lock, is a no-op:
        there, one writer per location is the caller's to keep.
        """
        return lambda: None

    def scan(self, directory: str) -> None:
        """Learns the names and sizes under ``directory`` at once, where that saves a request
        per file later (object stores); elsewhere nothing. A missing directory is no error."""

    def discard(self, paths: Iterable[str]) -> None:
        """Best-effort deletes on a failure path, in parallel and without retries: the error
        being reported matters more than a leftover, which the next save removes anyway.
        The ``Executor``'s threads take work while the interpreter exits, so a failing save
        cleans up even then."""
        def remove_quietly(path: str) -> None:
            try:
                self.remove_once(path)
            except Exception as e:  # cleanup must not mask the failure being reported
                _LOG.warning("could not remove %s while cleaning up: %s", path, e)
        with Executor(_DISCARD_THREADS, name="orbax_safetensors-discard") as pool:
            pool.map(remove_quietly, paths)

    def remove_once(self, path: str) -> None:
        """``remove`` without retries (where the backend retries at all)."""
        self.remove(path)
