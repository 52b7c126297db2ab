"""Local (and shared POSIX) filesystems through file descriptors.

Reads use ``os.preadv`` straight into the caller's buffer: no intermediate
``bytes``, no second copy, and safe to call from many threads on one file.
Writes ``fsync`` before returning so a rename that follows commits durable
data, not a promise. Every ``OSError`` leaving this module names its file
(``os.write`` alone would report ENOSPC without one), and only regular files
are ever opened for reading: a FIFO named like a shard would block an
``open`` forever, a device would read without end.

Symlinks are followed (a Hugging Face Hub cache snapshot is a directory of
symlinks into ``../../blobs/``): what is checked, pinned and identified is the
file a link points to, so a link to a FIFO or a directory gets the same error
as the FIFO or directory itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import shutil
import stat
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import BinaryIO

from orbax_safetensors.errors import CheckpointBusyError, SafetensorsError
from orbax_safetensors.storage.base import Capabilities, Storage


_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}


@contextlib.contextmanager
def _naming(path: str) -> Iterator[None]:
    """Gives an ``OSError`` raised without a file name (``os.write``, ``os.fsync``) ``path``."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise type(e)(e.errno, e.strerror or os.strerror(e.errno), path) from e
        raise


def _check_regular(mode: int, path: str) -> None:
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise SafetensorsError(f"is {kind}, not a safetensors file", file=path)


def _open_regular(path: str) -> int:
    """A read descriptor of ``path``, refused unless it is a regular file (never blocks)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _check_regular(os.fstat(fd).st_mode, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


class LocalStorage(Storage):

    # A page-cache copy of 16 KiB costs about one syscall; renames are metadata; every
    # process of a save can write its ranges into one shared file.
    capabilities = Capabilities(offset_writes=True, cheap_rename=True, max_gap=16 << 10)

    def join(self, directory: str, name: str) -> str:
        return os.path.join(directory, name)

    def split(self, path: str) -> tuple[str, str]:
        return os.path.split(path)

    def size(self, path: str) -> int:
        info = os.stat(path)
        _check_regular(info.st_mode, path)
        return info.st_size

    def modified(self, path: str) -> int | None:
        return os.stat(path).st_mtime_ns

    def read(self, path: str, offset: int, length: int) -> bytes:
        fd = _open_regular(path)
        try:
            with _naming(path):
                return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def read_scatter(self, path: str, offset: int, buffers: Sequence[memoryview]) -> None:
        fd = _open_regular(path)
        try:
            _vectored(os.preadv, fd, buffers, offset, path)
        finally:
            os.close(fd)

    def write(self, path: str, chunks: Iterable[memoryview | bytes]) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            with _naming(path):
                for chunk in chunks:
                    view = memoryview(chunk).cast("B")
                    while len(view):
                        view = view[os.write(fd, view):]
                os.fsync(fd)
        finally:
            os.close(fd)

    def create_sized(self, path: str, size: int, head: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            with _naming(path):
                os.pwrite(fd, head, 0)
                # Reserve the blocks now where the filesystem can: a full disk fails here,
                # before any process writes, not halfway through the data.
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        raise
                    os.ftruncate(fd, size)
                os.fsync(fd)
        finally:
            os.close(fd)

    def write_at(self, path: str, offset: int, buffers: Sequence[memoryview]) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            _vectored(os.pwritev, fd, buffers, offset, path)
        finally:
            os.close(fd)

    def sync(self, path: str) -> None:
        _fsync(path)

    def open_read(self, path: str) -> BinaryIO:
        return os.fdopen(_open_regular(path), "rb")

    def special_kind(self, path: str) -> str | None:
        try:
            mode = os.stat(path).st_mode  # stat'ed, never opened: a FIFO's open would block
        except FileNotFoundError:
            try:
                return f"a symbolic link to {os.readlink(path)!r}, which does not exist"
            except OSError:  # not a link: nothing there
                return None
        except OSError:
            return None
        if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
            return None
        return _KINDS.get(stat.S_IFMT(mode), "a special file")

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def list_versions(self, path: str) -> dict[str, str]:
        """Inodes, free from ``scandir``: a rename over a name brings another inode. A
        symlink's version is its target's (a Hub cache snapshot's files are symlinks into
        ``blobs/``, and what a read sees changes with the target, not with the link)."""
        with os.scandir(path) as entries:
            return {entry.name: _version(entry) for entry in entries}

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def make_directories(self, path: str) -> list[str]:
        missing, parent = [], os.path.abspath(path)
        while not os.path.exists(parent):
            missing.append(parent)
            parent = os.path.dirname(parent)
        self.makedirs(path)
        return missing

    def remove_empty_directory(self, path: str) -> bool:
        try:
            os.rmdir(path)  # only ever an empty one
        except OSError:
            return False
        return True

    def rename(self, source: str, destination: str, *, durable: bool = True) -> None:
        os.replace(source, destination)
        if durable:
            self.sync_directory(os.path.dirname(destination) or ".")

    def sync_directory(self, directory: str) -> None:
        _fsync(directory)

    def remove(self, path: str) -> None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass

    def remove_tree(self, path: str) -> None:
        """Removes ``path`` and everything in it; an entry that vanishes meanwhile (a lock file
        its writer just released) is gone already, not an error."""
        def gone(function, entry, error) -> None:
            if not isinstance(error, FileNotFoundError):
                raise error

        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=gone)
        else:  # onerror: deprecated from 3.12
            shutil.rmtree(path, onerror=lambda function, entry, info: gone(function, entry, info[1]))

    def rename_tree(self, source: str, destination: str) -> None:
        os.rename(source, destination)
        self.sync_directory(os.path.dirname(destination) or ".")

    def snapshot(self) -> LocalSnapshot:
        return LocalSnapshot()

    def lock(self, path: str, holder: str) -> Callable[[], None]:
        """``flock`` on ``path``: the kernel frees it when its holder dies, on any host for NFS
        (where Linux maps it onto POSIX locks), and it conflicts between two descriptors of
        one process too, so two threads of one process are two writers as well."""
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    current = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
                finally:
                    os.close(fd)
                raise CheckpointBusyError(path, current or "holder not yet recorded") from None
            except BaseException:
                os.close(fd)
                raise
            try:  # a releasing holder unlinks the file: a lock on an unlinked file locks nothing
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        with _naming(path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder.encode(), 0)

        def release() -> None:
            try:
                os.unlink(path)  # while still holding it: nobody can lock this inode again
            finally:
                os.close(fd)
        return release


class LocalSnapshot(LocalStorage):
    """Reads each file through one descriptor opened at its first use (see ``Storage.snapshot``).

    An overwrite renames new files over the old names; an open descriptor keeps
    reading the old file, so a load that opened everything it needs before the
    commit reads only the old checkpoint, and ``unchanged`` tells it whether the
    names it resolved still point at what it opened.
    """

    capabilities = dataclasses.replace(LocalStorage.capabilities, pins_versions=True)

    def __init__(self):
        self._open: dict[str, tuple[int, tuple[int, int, int, int]]] = {}
        self._guard = threading.Lock()

    def _fd(self, path: str) -> int:
        with self._guard:
            if path not in self._open:
                fd = _open_regular(path)
                info = os.fstat(fd)
                self._open[path] = (fd, (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns))
            return self._open[path][0]

    def version(self) -> str:
        with self._guard:
            return repr(sorted((path, identity) for path, (_, identity) in self._open.items()))

    def size(self, path: str) -> int:
        return os.fstat(self._fd(path)).st_size

    def modified(self, path: str) -> int | None:
        return os.fstat(self._fd(path)).st_mtime_ns  # of the version read, whatever the name holds now

    def read(self, path: str, offset: int, length: int) -> bytes:
        with _naming(path):
            return os.pread(self._fd(path), length, offset)

    def read_scatter(self, path: str, offset: int, buffers: Sequence[memoryview]) -> None:
        _vectored(os.preadv, self._fd(path), buffers, offset, path)

    def open_read(self, path: str) -> BinaryIO:
        return os.fdopen(os.dup(self._fd(path)), "rb")

    def unchanged(self, relocate: Callable[[str], str | None] = lambda path: path) -> bool:
        with self._guard:
            pinned = list(self._open.items())
        for path, (_, identity) in pinned:
            now = relocate(path)
            try:
                info = os.stat(now) if now is not None else None
            except FileNotFoundError:
                info = None
            if info is None or (info.st_dev, info.st_ino) != identity[:2]:
                return False
        return True

    def close(self) -> None:
        with self._guard:
            pinned, self._open = self._open, {}
        for fd, _ in pinned.values():
            os.close(fd)

    def __del__(self):
        self.close()


def _version(entry: os.DirEntry) -> str:
    if not entry.is_symlink():
        return str(entry.inode())
    try:
        target = entry.stat()  # follows the link
        return f"{target.st_dev}:{target.st_ino}"
    except OSError:  # dangling (or a loop): reading it fails, naming the file
        return f"dangling {entry.inode()}"


def _vectored(call, fd: int, buffers: Sequence[memoryview], offset: int, path: str) -> None:
    """``preadv``/``pwritev`` of all ``buffers`` (contiguous: memoryviews, bytes, numpy arrays)
    from ``offset``, resuming after short transfers. The buffers go to the call as they are:
    a byte view of each costs more than reading a small tensor."""
    views = list(buffers)
    sizes = [len(view) if isinstance(view, (bytes, bytearray)) else view.nbytes for view in views]
    position, start = offset, 0
    while start < len(views):
        batch = views[start:start + _IOV_MAX]
        with _naming(path):
            done = call(fd, batch, position)
        if done == 0 and any(sizes[start:start + _IOV_MAX]):
            raise EOFError(f"{path}: file ended at byte {position}")
        position += done
        while start < len(views) and done >= sizes[start]:  # skip finished buffers
            done -= sizes[start]
            start += 1
        if done:
            views[start] = memoryview(views[start]).cast("B")[done:]
            sizes[start] -= done


def _fsync(path: str) -> None:
    """Flushes a file's data, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        with _naming(path):
            os.fsync(fd)
    finally:
        os.close(fd)
