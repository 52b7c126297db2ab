"""Local (and shared POSIX) filesystems through file descriptors.

Reads use ``os.preadv`` straight into the caller's buffer: no intermediate
``bytes``, no second copy, and safe to call from many threads on one file.
Writes ``fsync`` before returning so a rename that follows commits durable
data, not a promise.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import BinaryIO

from orbax_safetensors.storage.base import Storage


_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class LocalStorage(Storage):

    default_max_gap = 16 << 10  # a page-cache copy of 16 KiB costs about one syscall

    def join(self, directory: str, name: str) -> str:
        return os.path.join(directory, name)

    def split(self, path: str) -> tuple[str, str]:
        return os.path.split(path)

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def read(self, path: str, offset: int, length: int) -> bytes:
        with open(path, "rb", buffering=0) as f:
            return os.pread(f.fileno(), length, offset)

    def read_scatter(self, path: str, offset: int, buffers: Sequence[memoryview]) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            _vectored(os.preadv, fd, buffers, offset, path)
        finally:
            os.close(fd)

    def write(self, path: str, chunks: Iterable[memoryview | bytes]) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                while len(view):
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    supports_offset_writes = True

    def create_sized(self, path: str, size: int, head: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(fd, head, 0)
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_at(self, path: str, offset: int, buffers: Sequence[memoryview]) -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            _vectored(os.pwritev, fd, buffers, offset, path)
        finally:
            os.close(fd)

    def sync(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def open_read(self, path: str) -> BinaryIO:
        return open(path, "rb")

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def rename(self, source: str, destination: str) -> None:
        os.replace(source, destination)
        _fsync_directory(os.path.dirname(destination) or ".")

    def remove(self, path: str) -> None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def _vectored(call, fd: int, buffers: Sequence[memoryview], offset: int, path: str) -> None:
    """``preadv``/``pwritev`` of all ``buffers`` from ``offset``, resuming after short transfers."""
    views = [memoryview(b).cast("B") for b in buffers]
    position, start = offset, 0
    while start < len(views):
        batch = views[start:start + _IOV_MAX]
        done = call(fd, batch, position)
        if done == 0 and any(len(v) for v in batch):
            raise EOFError(f"{path}: file ended at byte {position}")
        position += done
        while start < len(views) and done >= len(views[start]):  # skip finished buffers
            done -= len(views[start])
            start += 1
        if done:
            views[start] = views[start][done:]


def _fsync_directory(directory: str) -> None:
    """Makes a rename durable: the new directory entry survives a power cut."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
