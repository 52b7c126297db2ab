"""Any fsspec filesystem (``memory://``, ``gs://``, ``s3://``, ...).

Object stores have no writes at offsets and no rename; this backend maps the
interface onto what fsspec offers (ranged ``cat_file``, streaming ``open``,
``mv``). A checkpoint on such a store is committed by writing its commit
marker last, which the engine does for every backend alike.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable

import fsspec

from orbax_safetensors.storage.base import Storage


class FsspecStorage(Storage):

    def __init__(self, fs: fsspec.AbstractFileSystem):
        self.fs = fs

    def join(self, directory: str, name: str) -> str:
        return posixpath.join(directory, name)

    def split(self, path: str) -> tuple[str, str]:
        return posixpath.split(path)

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def read(self, path: str, offset: int, length: int) -> bytes:
        return self.fs.cat_file(path, start=offset, end=offset + length)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        view = memoryview(buffer).cast("B")
        data = self.read(path, offset, len(view))
        if len(data) != len(view):
            raise EOFError(
                f"{path}: got {len(data)} bytes at offset {offset}, expected {len(view)}")
        view[:] = data

    def write(self, path: str, chunks: Iterable[memoryview | bytes]) -> None:
        with self.fs.open(path, "wb") as f:
            for chunk in chunks:
                f.write(chunk)

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def isdir(self, path: str) -> bool:
        return bool(self.fs.isdir(path))

    def listdir(self, path: str) -> list[str]:
        return [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False)]

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def rename(self, source: str, destination: str) -> None:
        self.fs.mv(source, destination)

    def remove(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path)
